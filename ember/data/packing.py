"""Documents -> one flat token stream (EOS after each document) -> fixed-length training samples.

Packing documents end to end, with no padding, is how GPT-style pretraining spends every position on
a real token (GPT-2/3, Llama). Where the tokens are kept on disk (the automatic cache, prepared shards)
is prepare.py's business, which builds on this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
    # SFT: 1 where the token is a training target (response and EOS), 0 for prompt tokens; None: all are.
    loss_mask: Optional[np.ndarray] = None


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


def tokenize_prompted(prompts: list[str], responses: list[str], tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """SFT documents: prompt + response + EOS each, and a loss mask that is 0 on the prompt tokens."""
    dtype = token_dtype(tokenizer.vocab_size)
    tokens: list[np.ndarray] = []
    mask: list[np.ndarray] = []
    for start in range(0, len(prompts), ENCODE_BATCH_DOCS):
        batch_p = tokenizer.encode_batch(prompts[start : start + ENCODE_BATCH_DOCS])
        batch_r = tokenizer.encode_batch(responses[start : start + ENCODE_BATCH_DOCS])
        for p, r in zip(batch_p, batch_r):
            tokens.append(np.asarray(p + r + [tokenizer.eos_id], dtype=dtype))
            mask.append(np.concatenate([np.zeros(len(p), np.uint8), np.ones(len(r) + 1, np.uint8)]))
    if not tokens:
        return np.zeros(0, dtype), np.zeros(0, np.uint8)
    return np.concatenate(tokens), np.concatenate(mask)


def tokenize_source(data_cfg: Any, tokenizer: Tokenizer, split: str) -> TokenStream:
    """Read one split of the configured source and tokenize it (no cache: see prepare.token_stream)."""
    docs = sources.load_documents(data_cfg, split)
    if docs.prompts is not None:
        tokens, mask = tokenize_prompted(docs.prompts, docs.texts, tokenizer)
        return TokenStream(tokens, docs.name, len(docs.texts), docs.skipped, loss_mask=mask)
    return TokenStream(tokenize_documents(docs.texts, tokenizer), docs.name, len(docs.texts), docs.skipped)


def pack(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """(num_tokens,) -> (num_samples, seq_len + 1): consecutive, non-overlapping windows, the tail dropped.

    A view, not a copy, so a memory-mapped stream stays on disk until a batch reads its rows.
    Row i gives inputs row[:-1] and labels row[1:].
    """
    window = seq_len + 1
    num_samples = len(tokens) // window
    return tokens[: num_samples * window].reshape(num_samples, window)
