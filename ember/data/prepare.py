"""Pre-tokenized shards: tokenize a source once, train from memory-mapped token files with no tokenizer cost.

`ember data prepare SOURCE OUT_DIR` writes, per split, `OUT_DIR/<split>.bin` (the flat token stream, EOS
after every document, as uint16 or uint32) and one `OUT_DIR/manifest.json`:

    {"format": "ember-tokens", "version": 1, "source": ..., "text_field": ..., "val_fraction": ...,
     "tokenizer": {"identity", "source", "vocab_size", "eos_id"},
     "splits": {"train": {"file", "dtype", "num_tokens", "num_documents", "sha256"}, "val": {...}}}

Training with `data.dataset=OUT_DIR` maps the .bin files; a manifest whose tokenizer identity differs
from the run's tokenizer is refused, and a .bin whose size disagrees with the manifest (a truncated
copy) is refused too. The checksum is recorded for `ember data verify`-style audits; checking it on
every start would read the whole dataset. With val_fraction 0 there is no val split (no val.bin, no
"val" entry): a run on it trains without validation.

OUT_DIR is new or empty, or replaced only when asked (check_out_dir): it may hold the shards a run trains
on. It is written beside and swapped in whole, so a failure leaves it as it was.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional

import numpy as np

from ember.config_schema import DataConfig
from ember.constants import default_cache_dir
from ember.data import chat, packing, sources
from ember.data.tokenizer import AnyTokenizer
from ember.errors import ConfigError, DataError
from ember.storage.staging import staged

MANIFEST = "manifest.json"
FORMAT, VERSION = "ember-tokens", 1
DOCS_PER_CHUNK = 4096  # documents tokenized per encode_batch call (the Rust encoder uses every core)


def is_prepared(spec: str) -> bool:
    return (Path(spec).expanduser() / MANIFEST).is_file()


def check_out_dir(data_cfg: DataConfig, out_dir: Path, overwrite: bool) -> None:
    """Preparing writes into a new or empty `out_dir`; over a non-empty one only with `overwrite` (it may hold the
    shards a run trains on, which then would no longer match that run's tokenizer), and never over what it reads
    (the source's files, the tokenizer): swapping the new shards in would delete them."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"OUT_DIR '{out_dir}' is a file, not a directory: give a new or empty directory")
    if not out_dir.exists() or not any(out_dir.iterdir()):
        return
    target = out_dir.resolve()
    local = [] if data_cfg.dataset in (sources.EMBEDDED, sources.SYNTHETIC) else sources.local_files(data_cfg.dataset)
    for read in [*(local or []), *([Path(data_cfg.tokenizer)] if data_cfg.tokenizer else [])]:
        resolved = read.expanduser().resolve()
        if resolved == target or target in resolved.parents:
            raise ConfigError(f"'{out_dir}' holds '{read}', which preparing reads; replacing '{out_dir}' would delete "
                              "it: write to another OUT_DIR")
    if not overwrite:
        raise ConfigError(f"'{out_dir}' is not empty; give --overwrite to replace what it holds, or write to a new "
                          "OUT_DIR")


def prepare(data_cfg: DataConfig, tokenizer: AnyTokenizer, out_dir: Path,
            progress: Optional[Callable[[str, int, int], None]] = None, overwrite: bool = False) -> dict:
    """Tokenize the splits of data_cfg.dataset into out_dir (see check_out_dir); returns the manifest.

    Every split's documents are read before any is tokenized, so a source too small to split fails before the
    work. Each .bin is streamed to disk chunk by chunk (never the whole corpus in memory twice) into a directory
    beside out_dir, which replaces out_dir once the manifest is written: out_dir is whole or as it was.
    """
    check_out_dir(data_cfg, out_dir, overwrite)
    splits = sources.SPLITS if data_cfg.val_fraction > 0 else ("train",)  # 0: no held-out documents, no val split
    documents = {split: sources.load_documents(data_cfg, split) for split in splits}
    if any(docs.conversations is not None for docs in documents.values()):
        raise DataError("ember data prepare does not take chat data (data.messages_field) yet; train from the "
                        "file itself: its tokens are cached on first use")
    dtype = packing.token_dtype(tokenizer.vocab_size)
    manifest: dict[str, Any] = {
        "format": FORMAT, "version": VERSION, "source": data_cfg.dataset, "text_field": data_cfg.text_field,
        "val_fraction": data_cfg.val_fraction,
        "tokenizer": {"identity": tokenizer.identity, "source": tokenizer.source, "vocab_size": tokenizer.vocab_size,
                      "eos_id": tokenizer.eos_id},
        "splits": {},
    }
    with staged(out_dir, "prepare", directory=True) as stage:
        for split, docs in documents.items():
            manifest["splits"][split] = _write_split(stage, split, docs, tokenizer, dtype, progress)
        sources.atomic_write(stage / MANIFEST, lambda f: f.write((json.dumps(manifest, indent=2) + "\n").encode()))
    return manifest


def _write_split(stage: Path, split: str, docs: sources.Documents, tokenizer: AnyTokenizer, dtype: type,
                 progress: Optional[Callable[[str, int, int], None]]) -> dict:
    """Tokenizes one split into stage/<split>.bin (and its loss mask for SFT rows); returns its manifest entry."""
    digest, num_tokens = hashlib.sha256(), 0
    path, mask_path = stage / f"{split}.bin", stage / f"{split}.mask.bin"
    masks: list[np.ndarray] = []

    def write(f: BinaryIO) -> None:
        nonlocal num_tokens
        for start in range(0, len(docs.texts), DOCS_PER_CHUNK):
            texts = docs.texts[start : start + DOCS_PER_CHUNK]
            if docs.prompts is None:
                chunk = packing.tokenize_documents(texts, tokenizer)
            else:  # SFT: the loss mask (1 byte a token) is kept beside the tokens
                chunk, mask = packing.tokenize_prompted(docs.prompts[start : start + DOCS_PER_CHUNK], texts, tokenizer)
                masks.append(mask)
            data = chunk.astype(dtype, copy=False).tobytes()
            f.write(data)
            digest.update(data)
            num_tokens += len(chunk)
            if progress:
                progress(split, min(start + DOCS_PER_CHUNK, len(docs.texts)), len(docs.texts))

    sources.atomic_write(path, write)
    info = {"file": path.name, "dtype": np.dtype(dtype).name, "num_tokens": num_tokens,
            "num_documents": len(docs.texts), "sha256": digest.hexdigest(), "skipped": docs.skipped}
    if docs.prompts is not None:
        sources.atomic_write(mask_path, lambda f: [f.write(m.tobytes()) for m in masks])
        info["mask_file"] = mask_path.name
    return info


def read_manifest(directory: Path) -> dict:
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"'{path}' is not a readable manifest ({err}); run `ember data prepare` again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise DataError(f"'{path}' is not an {FORMAT} v{VERSION} manifest; run `ember data prepare` again")
    return manifest


def load_prepared(directory: Path, split: str, tokenizer: AnyTokenizer) -> packing.TokenStream:
    """The memory-mapped tokens of one split, after checking the tokenizer and the file size."""
    manifest = read_manifest(directory)
    expected = manifest["tokenizer"]
    if expected["identity"] != tokenizer.identity:
        raise DataError(
            f"'{directory}' was tokenized with {expected['source']} (identity {expected['identity']}), but this run "
            f"uses {tokenizer.source} (identity {tokenizer.identity}); set data.tokenizer to the same tokenizer "
            "or run `ember data prepare` again with this one"
        )
    info = manifest["splits"].get(split)
    if info is None and split == "val" and manifest.get("val_fraction") == 0:  # a run on it: "no validation: ..."
        raise DataError(f"'{directory}' holds no val split (prepared with --val-fraction 0); prepare it with a "
                        "--val-fraction above 0 to validate on it")
    if info is None:
        raise DataError(f"'{directory / MANIFEST}' has no '{split}' split; run `ember data prepare` again")
    path = directory / info["file"]
    dtype = np.dtype(info["dtype"])
    size = path.stat().st_size if path.is_file() else -1
    if size != info["num_tokens"] * dtype.itemsize:
        raise DataError(
            f"'{path}' holds {max(size, 0)} bytes but the manifest says {info['num_tokens']} {dtype.name} tokens "
            f"({info['num_tokens'] * dtype.itemsize} bytes): the copy is incomplete; copy or prepare it again"
        )
    tokens = np.memmap(path, dtype=dtype, mode="r") if info["num_tokens"] else np.zeros(0, dtype)
    mask = None
    if info.get("mask_file"):
        mask_path = directory / info["mask_file"]
        if not mask_path.is_file() or mask_path.stat().st_size != info["num_tokens"]:
            raise DataError(f"'{mask_path}' is missing or not {info['num_tokens']} bytes; prepare the data again")
        mask = np.memmap(mask_path, dtype=np.uint8, mode="r") if info["num_tokens"] else np.zeros(0, np.uint8)
    return packing.TokenStream(tokens, f"{directory} ({manifest['source']})", info["num_documents"],
                               info.get("skipped", []), loss_mask=mask)


def token_stream(data_cfg: DataConfig, tokenizer: AnyTokenizer, split: str, cache_dir: Optional[Path] = None,
                 pad_to: Optional[int] = None) -> packing.TokenStream:
    """The tokens of one split, from the cache when the source has a fingerprint and was seen before.

    The cache key is (source fingerprint, tokenizer identity, split), and for chat data the chat template,
    with pad_to (data.packing=false: one document per pad_to tokens): a changed file, corpus, val_fraction,
    tokenizer or template gives a new entry, never a stale one.
    """
    if data_cfg.dataset not in (sources.EMBEDDED, sources.SYNTHETIC) and is_prepared(data_cfg.dataset):
        if pad_to is not None:
            raise DataError(f"'{data_cfg.dataset}' holds prepared, packed tokens, and data.packing=false pads each "
                            "document as it is tokenized; train from the source files or set data.packing=true")
        return load_prepared(Path(data_cfg.dataset).expanduser(), split, tokenizer)
    template = None
    if getattr(data_cfg, "messages_field", None):
        template = chat.load_template(getattr(data_cfg, "chat_template", None), tokenizer)
    fingerprint = sources.source_fingerprint(data_cfg)
    if fingerprint is None:  # the hub: `datasets` keeps its own cache of the text
        return packing.tokenize_source(data_cfg, tokenizer, split, template, pad_to)
    if template is not None or pad_to is not None:  # other entries keep their keys
        fingerprint = sources.short_hash(fingerprint, template.identity if template else None, pad_to)
    stem = (cache_dir or default_cache_dir()) / "tokens" / f"{fingerprint}-{tokenizer.identity}-{split}"
    npy, meta, mask_npy = stem.with_suffix(".npy"), stem.with_suffix(".json"), stem.with_suffix(".mask.npy")
    if npy.is_file() and meta.is_file():
        try:
            info = json.loads(meta.read_text(encoding="utf-8"))
            has_mask = info.pop("has_mask", False)
            tokens = np.load(npy, mmap_mode="r", allow_pickle=False)
            mask = np.load(mask_npy, mmap_mode="r", allow_pickle=False) if has_mask else None
            return packing.TokenStream(tokens, **info, loss_mask=mask)
        except (OSError, ValueError, TypeError):
            pass  # a damaged entry is rebuilt, never fatal
    stream = packing.tokenize_source(data_cfg, tokenizer, split, template, pad_to)
    info = {"name": stream.name, "num_documents": stream.num_documents, "skipped": stream.skipped,
            "has_mask": stream.loss_mask is not None}
    # The .json and the mask go first: the .npy appearing is what marks the entry complete.
    sources.atomic_write(meta, lambda f: f.write(json.dumps(info).encode()))
    if stream.loss_mask is not None:
        sources.atomic_write(mask_npy, lambda f: np.save(f, stream.loss_mask, allow_pickle=False))
    sources.atomic_write(npy, lambda f: np.save(f, stream.tokens, allow_pickle=False))
    return stream
