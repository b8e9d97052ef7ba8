"""Document sources: the embedded corpus, local files and Hugging Face hub datasets, as lists of strings.

Every source is read the same way: documents get a stable key (a relative path, or `path:row`), and a
hash of that key puts each one in the train or the held-out validation split, so the split never
depends on file order, on the machine, or on how many documents there are.

The embedded corpus is the `.py` source of the running Python's standard library (~30 MB, ~1800 files
for CPython 3.11): real text that every machine already has, so `ember train` needs no download.
"""

from __future__ import annotations

import glob
import hashlib
import os
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Iterable, Optional, Union

from ember.config_schema import DataConfig, JobConfig
from ember.data.hub import import_datasets, load_hub_table
from ember.data.jsonl import json_rows
from ember.errors import ConfigError, DataError, EmberError, UserFileNotFound, first_error_line
from ember.storage.location import check_source_url

if TYPE_CHECKING:
    import datasets

EMBEDDED = "embedded"
SYNTHETIC = "synthetic"
LOCAL_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet", ".arrow")
SPLITS = ("train", "val")


@dataclass
class Documents:
    """The texts of one split of one source, and what could not be read (for the run's log)."""

    name: str  # how messages name the source: a path, a hub name, or "embedded corpus (...)"
    texts: list[str]
    skipped: list[str] = field(default_factory=list)  # files that are not valid UTF-8
    # SFT data (data.prompt_field set): the prompt of each document, which is read but not trained on.
    prompts: Optional[list[str]] = None
    # Chat SFT data (data.messages_field set): one list of {"role", "content"} messages per document, in
    # place of texts (which stays empty); ember/data/chat.py renders and masks them.
    conversations: Optional[list[list[dict]]] = None

    @property
    def num_documents(self) -> int:
        return len(self.conversations) if self.conversations is not None else len(self.texts)


# ---------------------------------------------------------------- cache directory, atomic writes
def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write through a temporary file in the same folder, then rename it into place.

    A run killed halfway (or two runs racing to fill the same cache entry) leaves either no file or a
    whole one, never a truncated file that a later run would trust.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; a cache may be shared by a team
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def short_hash(*parts: object) -> str:
    return hashlib.sha256("\x1f".join(map(str, parts)).encode()).hexdigest()[:16]


# ---------------------------------------------------------------- the train/val split
def _unit_hash(key: str) -> float:
    """A key -> a number in [0, 1), the same on every machine (unlike Python's salted hash())."""
    return int.from_bytes(hashlib.sha1(key.encode()).digest()[:8], "big") / 2**64


def split_keys(keys: list[str], val_fraction: float) -> dict[str, list[str]]:
    """Keys -> {"train": [...], "val": [...]}, each in the input order.

    A key goes to val when its hash falls under val_fraction. A small corpus can draw no val key at
    all; then the key with the smallest hash is held out, so a validation split exists whenever there
    are two documents or more.
    """
    if not 0 <= val_fraction < 1:
        raise DataError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
    hashes = {k: _unit_hash(k) for k in keys}
    val = {k for k in keys if hashes[k] < val_fraction}
    if val_fraction > 0 and not val and len(keys) >= 2:
        val = {min(keys, key=hashes.__getitem__)}
    return {"train": [k for k in keys if k not in val], "val": [k for k in keys if k in val]}


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise DataError(f"unknown split '{split}'; use one of {', '.join(SPLITS)}")


def read_utf8(path: Path) -> Optional[str]:
    """A file's text, or None when it is not valid UTF-8 (the caller skips it and counts it)."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None


# ---------------------------------------------------------------- the embedded corpus
def embedded_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def embedded_files(root: Optional[Path] = None) -> list[str]:
    """Relative POSIX paths of the corpus's .py files, sorted; installed packages are not the stdlib."""
    root = root or embedded_root()
    files = []
    for folder, subdirs, names in os.walk(root):
        # Pruned while walking: site-packages can be far larger than the stdlib itself.
        subdirs[:] = [d for d in subdirs if d not in ("site-packages", "dist-packages", "__pycache__")]
        rel = Path(folder).relative_to(root)
        files += [(rel / n).as_posix() for n in names if n.endswith(".py")]
    return sorted(files)


def embedded_fingerprint(root: Optional[Path] = None) -> str:
    """Python version + file count + total size: changes when the corpus does, costs only stat calls."""
    root = root or embedded_root()
    files = embedded_files(root)
    total = sum((root / f).stat().st_size for f in files)
    return short_hash(sys.version_info[:3], len(files), total)


def embedded_name() -> str:
    return f"embedded corpus (Python {sys.version_info.major}.{sys.version_info.minor} stdlib at {embedded_root()})"


def load_embedded(split: str, val_fraction: float) -> Documents:
    """The corpus's train or val files, skipping (and counting) those that are not UTF-8."""
    _check_split(split)
    root = embedded_root()
    files = split_keys(embedded_files(root), val_fraction)[split]
    docs = Documents(embedded_name(), [])
    for rel in files:
        text = read_utf8(root / rel)
        if text is None:
            docs.skipped.append(rel)
        elif text:
            docs.texts.append(text)
    if not docs.texts:
        raise DataError(f"{docs.name} has no readable .py files in its {split} split; use data.dataset=synthetic")
    return docs


# ---------------------------------------------------------------- local files
def _is_glob(spec: str) -> bool:
    return any(c in spec for c in "*?[")


def local_files(spec: str, suffixes: tuple[str, ...] = LOCAL_SUFFIXES) -> Optional[list[Path]]:
    """The files a local file/dir/glob names, sorted; None when `spec` is not a local path at all."""
    path = Path(spec).expanduser()
    if _is_glob(spec):
        files = [Path(p) for p in sorted(glob.glob(str(path), recursive=True)) if Path(p).is_file()]
        if not files:
            raise UserFileNotFound(f"data.dataset glob '{spec}' matches no files; check the pattern")
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in suffixes)
        if not files:
            raise DataError(
                f"data.dataset folder '{spec}' holds no {'/'.join(suffixes)} files; add some or point elsewhere"
            )
    elif path.is_file():
        files = [path]
    else:
        return None
    for f in files:
        if f.suffix not in suffixes:
            raise DataError(f"data.dataset file '{f}' is not one of {'/'.join(suffixes)}; convert or rename it")
    return files


def check_source_exists(spec: str, key: str) -> None:
    """Refuse, before any work, a source that names a local path that is not there (`key`: the config key
    that named it). Whether an existing path holds readable data is found when it is read."""
    if "://" in spec:  # read from its local copy (ember/storage/cache.py's local_data): there now, before any work
        return check_source_url(spec, key)
    if spec in (EMBEDDED, SYNTHETIC) or glob.has_magic(spec):
        return
    if not Path(spec).expanduser().exists() and looks_like_path(spec):
        raise UserFileNotFound(f"{key} path '{spec}' does not exist; check the path")


def looks_like_path(spec: str) -> bool:
    # Hub names are `name` or `owner/name`; anything else that is not on disk is a mistyped path.
    return (spec.startswith(("/", ".", "~")) or spec.endswith("/") or Path(spec).suffix in LOCAL_SUFFIXES
            or spec.count("/") > 1)


def _field(row: Any, name: str, where: str, key: str = "text_field") -> str:
    """row[name] as text; `key` is the data.* key that names the field, so the error points at it."""
    if not isinstance(row, dict) or name not in row:
        keys = ", ".join(map(str, row)) if isinstance(row, dict) else type(row).__name__
        raise DataError(f"{where} has no '{name}' field (it has: {keys}); set data.{key} to the right column")
    text = row[name]
    if not isinstance(text, str):
        raise DataError(f"{where} field '{name}' is {type(text).__name__}, not text; set data.{key}")
    return text


# A document's text, (prompt, response) for SFT data, or a conversation's messages for chat SFT data.
Row = Union[str, tuple[str, str], list[dict]]


@dataclass(frozen=True)
class Fields:
    """The columns a row is read from: the text, and for SFT the prompt, or for chat SFT the messages."""

    text: str = "text"
    prompt: Optional[str] = None
    messages: Optional[str] = None

    @staticmethod
    def of(data_cfg: DataConfig) -> "Fields":
        return Fields(data_cfg.text_field, getattr(data_cfg, "prompt_field", None),
                      getattr(data_cfg, "messages_field", None))

    @property
    def columns(self) -> list[tuple[str, str]]:
        """(column, the data.* key that names it) of every column a row needs."""
        if self.messages is not None:
            return [(self.messages, "messages_field")]
        return [(self.text, "text_field")] + ([(self.prompt, "prompt_field")] if self.prompt is not None else [])


def _row(row: Any, fields: Fields, where: str) -> Row:
    if fields.messages is not None:
        from ember.data.chat import check_messages  # local: only chat data needs it (and jinja2)

        if not isinstance(row, dict) or fields.messages not in row:
            keys = ", ".join(map(str, row)) if isinstance(row, dict) else type(row).__name__
            raise DataError(f"{where} has no '{fields.messages}' field (it has: {keys}); set data.messages_field "
                            "to the column holding the conversation's list of messages")
        return check_messages(row[fields.messages], f"{where} field '{fields.messages}'")
    text = _field(row, fields.text, where)
    return text if fields.prompt is None else (_field(row, fields.prompt, where, "prompt_field"), text)


def _has_content(row: Row) -> bool:
    # An empty (or null) document, or a prompt with no response, adds nothing to train on. A conversation
    # always has an assistant turn (check_messages refuses one without), so it always counts.
    return bool(row) if isinstance(row, (str, list)) else bool(row[1])


def _table_rows(path: Path, fields: Fields) -> list[Row]:
    """The text column (and prompt column), or the messages column, of a .parquet or .arrow file, read by
    `datasets`."""
    datasets = import_datasets(f"reading '{path}'")
    builder = "parquet" if path.suffix == ".parquet" else "arrow"
    try:
        table = datasets.load_dataset(builder, data_files=[str(path)], split="train")
    except Exception as err:
        raise DataError(f"{path} is not a readable {builder} file ({first_error_line(err)}); "
                        "fix or remove it") from None
    for name, key in fields.columns:
        if name not in table.column_names:
            raise DataError(
                f"{path} has no '{name}' column (it has: {', '.join(table.column_names)}); set data.{key}"
            )
    return _column_rows(table, fields, str(path))


def _column_rows(table: datasets.Dataset, fields: Fields, name: str) -> list[Row]:
    """The rows of a `datasets` table whose columns are known to be there."""
    if fields.messages is not None:
        return [_row({fields.messages: m}, fields, f"{name} row {i}") for i, m in enumerate(table[fields.messages])]
    if fields.prompt is None:
        return list(table[fields.text])
    return list(zip(table[fields.prompt], table[fields.text]))


def _local_documents(spec: str, files: list[Path], fields: Fields) -> tuple[dict[str, Row], list[str]]:
    """Every document of the files, keyed for the split: the file for .txt, `file:row` for the others."""
    docs: dict[str, Row] = {}
    skipped: list[str] = []
    # Keys relative to the files' common folder: the split is the same for `data/` and `/abs/data/`.
    base = Path(os.path.commonpath([f.parent.resolve() for f in files]))
    for path in files:
        if path.suffix == ".txt" and fields.messages is not None:
            raise DataError(f"{path} is plain text, but data.messages_field is set: chat data needs rows with a "
                            f"'{fields.messages}' list of messages (jsonl, json, parquet, arrow)")
        if path.suffix == ".txt" and fields.prompt is not None:
            raise DataError(f"{path} is plain text, but data.prompt_field is set: SFT data needs rows with a "
                             f"'{fields.prompt}' and a '{fields.text}' field (jsonl, json, parquet, arrow)")
        if path.suffix in (".parquet", ".arrow"):
            rows: Iterable[Row] = _table_rows(path, fields)
        else:
            text = read_utf8(path)
            if text is None:
                skipped.append(str(path))
                continue
            rows = [text] if path.suffix == ".txt" else [_row(row, fields, where)
                                                            for where, row in json_rows(path, text)]
        for i, row in enumerate(rows):
            if _has_content(row):
                docs[f"{path.resolve().relative_to(base).as_posix()}:{i}"] = row
    if not docs:
        why = f"{len(skipped)} of its files are not UTF-8 text (convert them)" if skipped else "it is empty (add text)"
        raise DataError(f"data.dataset '{spec}' yields no documents: {why}")
    return docs, skipped


def _documents(name: str, rows: list[Row], skipped: list[str], fields: Fields) -> Documents:
    if fields.messages is not None:
        return Documents(name, [], skipped, conversations=rows)  # type: ignore[arg-type]
    if fields.prompt is None:
        return Documents(name, rows, skipped)  # type: ignore[arg-type]
    return Documents(name, [r[1] for r in rows], skipped, prompts=[r[0] for r in rows])  # type: ignore[index]


def load_local(spec: str, files: list[Path], fields: Fields, split: str, val_fraction: float) -> Documents:
    _check_split(split)
    docs, skipped = _local_documents(spec, files, fields)
    keys = split_keys(list(docs), val_fraction)[split]
    if not keys and split == "val" and val_fraction == 0:
        raise DataError(f"data.val_fraction=0 holds no documents of data.dataset '{spec}' out for a val split")
    if not keys:
        raise DataError(
            f"data.dataset '{spec}' has {len(docs)} document(s), too few to hold one out for the {split} split "
            f"(data.val_fraction={val_fraction}); add documents"
        )
    return _documents(spec, [docs[k] for k in keys], skipped, fields)


# ---------------------------------------------------------------- Hugging Face hub
def load_hub(name: str, config: Optional[str], hf_split: str, fields: Fields, split: str,
             val_fraction: float) -> Documents:
    """A hub dataset's `hf_split` (data.split), divided into ember's train/val by the same key hash."""
    _check_split(split)
    table = load_hub_table(name, config, hf_split)
    for column, key in fields.columns:
        if column not in table.column_names:
            raise DataError(
                f"hub dataset '{name}' has no '{column}' column (it has: {', '.join(table.column_names)}); "
                f"set data.{key}"
            )
    rows = _column_rows(table, fields, f"hub dataset '{name}'")
    keys = [f"{name}:{hf_split}:{i}" for i in range(len(rows))]
    chosen = set(split_keys(keys, val_fraction)[split])
    kept = [row for key, row in zip(keys, rows) if key in chosen and _has_content(row)]
    return _documents(name, kept, [], fields)


# ---------------------------------------------------------------- one entry point
def load_documents(data_cfg: DataConfig, split: str = "train") -> Documents:
    """The documents of `split` ("train" or "val") of the source that data_cfg.dataset names."""
    spec = data_cfg.dataset
    if spec == SYNTHETIC:
        raise DataError("data.dataset=synthetic has no documents; it makes random tokens in the loader")
    if spec == EMBEDDED:
        return load_embedded(split, data_cfg.val_fraction)
    fields = Fields.of(data_cfg)
    files = local_files(spec)
    if files is not None:
        return load_local(spec, files, fields, split, data_cfg.val_fraction)
    if looks_like_path(spec):
        raise UserFileNotFound(f"data.dataset path '{spec}' does not exist; check the path")
    return load_hub(spec, data_cfg.config, data_cfg.split, fields, split, data_cfg.val_fraction)


def source_fingerprint(data_cfg: DataConfig) -> Optional[str]:
    """A key that changes when the documents of either split could; None where none is cheap (the hub)."""
    spec = data_cfg.dataset
    if spec == EMBEDDED:
        return short_hash(EMBEDDED, embedded_fingerprint(), data_cfg.val_fraction)
    files = local_files(spec) if spec != SYNTHETIC else None
    if not files:
        return None
    stats = [(f.resolve().as_posix(), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    fields = Fields.of(data_cfg)
    if fields.messages is None:  # unchanged for text and SFT data, so their existing caches stay valid
        return short_hash("local", stats, data_cfg.text_field, data_cfg.val_fraction, fields.prompt)
    return short_hash("local", stats, data_cfg.val_fraction, fields.messages)


def check(cfg: JobConfig) -> None:
    """data.dataset and each data.mixture source: a mistyped path fails here, once, not in every rank after the
    model is built (ember.train.run.load_config calls this)."""
    sources = [("data.dataset", cfg.data.dataset)] + [(f"data.mixture[{i}].source", item.source)
                                                      for i, item in enumerate(cfg.data.mixture)]
    try:
        for key, source in sources:
            check_source_exists(source, key)
    except EmberError as err:
        raise ConfigError(str(err)) from None
