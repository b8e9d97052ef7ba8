"""Documents -> one flat token stream (EOS after each document) -> fixed-length training samples.

Packing documents end to end, with no padding, is how GPT-style pretraining spends every position on
a real token (GPT-2/3, Llama). The stream of a cacheable source (the embedded corpus, local files) is
saved as .npy and memory-mapped on later runs, so the second run starts without tokenizing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ember.data import sources
from ember.data.tokenizer import Tokenizer

ENCODE_BATCH_DOCS = 256  # documents per encode_batch call: enough to keep every core busy, bounded memory


@dataclass
class TokenStream:
    tokens: np.ndarray  # (num_tokens,) uint16 or uint32, possibly a read-only memory map
    name: str  # the source, for messages
    num_documents: int
    skipped: list[str] = field(default_factory=list)  # files left out because they are not UTF-8


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 holds ids < 65536: half the disk and page cache of uint32 for every vocab up to 64k."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def tokenize_documents(texts: list[str], tokenizer: Tokenizer) -> np.ndarray:
    """Encode in batches and concatenate, with tokenizer.eos_id after every document."""
    dtype = token_dtype(tokenizer.vocab_size)
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    pieces: list[np.ndarray] = []
    for start in range(0, len(texts), ENCODE_BATCH_DOCS):
        for ids in tokenizer.encode_batch(texts[start : start + ENCODE_BATCH_DOCS]):
            pieces += [np.asarray(ids, dtype=dtype), eos]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)


def _tokenize(data_cfg: Any, tokenizer: Tokenizer, split: str) -> TokenStream:
    docs = sources.load_documents(data_cfg, split)
    return TokenStream(tokenize_documents(docs.texts, tokenizer), docs.name, len(docs.texts), docs.skipped)


def token_stream(data_cfg: Any, tokenizer: Tokenizer, split: str, cache_dir: Optional[Path] = None) -> TokenStream:
    """The tokens of one split, from the cache when the source has a fingerprint and was seen before.

    The cache key is (source fingerprint, tokenizer identity, split): a changed file, corpus, val_fraction
    or tokenizer gives a new entry, never a stale one.
    """
    from ember.data import prepare  # prepare builds on this module

    if data_cfg.dataset not in (sources.EMBEDDED, sources.SYNTHETIC) and prepare.is_prepared(data_cfg.dataset):
        return prepare.load_prepared(Path(data_cfg.dataset).expanduser(), split, tokenizer)
    fingerprint = sources.source_fingerprint(data_cfg)
    if fingerprint is None:  # the hub: `datasets` keeps its own cache of the text
        return _tokenize(data_cfg, tokenizer, split)
    stem = (cache_dir or sources.default_cache_dir()) / "tokens" / f"{fingerprint}-{tokenizer.identity}-{split}"
    npy, meta = stem.with_suffix(".npy"), stem.with_suffix(".json")
    if npy.is_file() and meta.is_file():
        try:
            tokens = np.load(npy, mmap_mode="r", allow_pickle=False)
            return TokenStream(tokens, **json.loads(meta.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):
            pass  # a damaged entry is rebuilt, never fatal
    stream = _tokenize(data_cfg, tokenizer, split)
    info = {"name": stream.name, "num_documents": stream.num_documents, "skipped": stream.skipped}
    # The .json goes first: the .npy appearing is what marks the entry complete.
    sources.atomic_write(meta, lambda f: f.write(json.dumps(info).encode()))
    sources.atomic_write(npy, lambda f: np.save(f, stream.tokens, allow_pickle=False))
    return stream


def pack(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """(num_tokens,) -> (num_samples, seq_len + 1): consecutive, non-overlapping windows, the tail dropped.

    A view, not a copy, so a memory-mapped stream stays on disk until a batch reads its rows.
    Row i gives inputs row[:-1] and labels row[1:].
    """
    window = seq_len + 1
    num_samples = len(tokens) // window
    return tokens[: num_samples * window].reshape(num_samples, window)
