"""Local copies of what a run reads from object storage (model.init_from's HF directory or checkpoint, a LoRA
run's base), so that every rank of every restart on a host does not download a 70B model again.

A URL's copy lives in EMBER_CACHE/remote/<hash of the URL>/ with a manifest of what was copied (each object's
size and ETag or modification time). It is reused while the store's listing is unchanged and downloaded again
when it changed. The processes of a host take one file lock per URL, so one downloads and the others wait and
reuse. The cache is bounded by EMBER_REMOTE_CACHE_GB (default 200): the least recently used copies are removed
to make room, and a source larger than the bound is refused in one line rather than filling the disk.

A run's copy (its URL, or one of its checkpoints/step-N) is shaped as a run: RUN/config.yaml beside
RUN/checkpoints/step-N (the newest committed one for a run URL), so what reads a local run reads the copy alike
(tokenizer_for's data section, ppl's data, convert's tokenizer export, eval.json's place). A checkpoint's eval.json
is not copied: `ember eval` reads and writes it on the store, and writing it must not make the weights stale.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, Union

from ember.config_schema import DataConfig
from ember.constants import default_cache_dir
from ember.errors import ConfigError, DataError, UserFileNotFound, first_error_line
from ember.storage.location import as_path, is_url

MANIFEST = "manifest.json"


def cache_root() -> Path:
    return default_cache_dir() / "remote"


def cache_limit_bytes() -> int:
    text = os.environ.get("EMBER_REMOTE_CACHE_GB", "200")
    try:
        limit = float(text)
    except ValueError:
        raise ConfigError(f"EMBER_REMOTE_CACHE_GB={text} is not a number of GiB") from None
    return int(limit * 2**30)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def local_copy(path: Union[str, os.PathLike], key: str = "path") -> Path:
    """A local path for `path`: itself when local; for a URL, its cached copy (a directory's objects or one
    file), downloaded when missing or changed on the store. A run directory's copy holds only its newest complete
    checkpoint (what loading a run reads) and the run's config.yaml."""
    if not is_url(str(path)):
        return as_path(str(path))
    url = str(path).rstrip("/")
    root, parts, model = _what_to_copy(as_path(url))
    listing = _listing(root, parts, url, key)
    entry = cache_root() / hashlib.sha256(url.encode()).hexdigest()[:16]
    with _locked(entry):
        manifest = _read_manifest(entry)
        if manifest.get("listing") != listing:
            _download(root, listing, entry, url, key)
        _touch(entry)
    return entry / "data" / root.name / model if model else entry / "data" / root.name


# What of a run is copied besides its checkpoint: what a model's readers look up in the run (tokenizer, data).
RUN_FILES = ("config.yaml",)
NOT_COPIED = ("eval.json",)  # a model's results, read and written on the store by `ember eval`


def _what_to_copy(remote) -> tuple:
    """(the root the copy is named after, its parts to copy ("" for all of it), the part that is the model
    ("" for the root)): a run's newest committed checkpoint and RUN_FILES; a run's checkpoints/step-N and
    RUN_FILES; anything else whole."""
    from ember.model_io.model_meta import MODEL_JSON

    step = _newest_checkpoint(remote)
    if step is not None:
        return remote, [f"checkpoints/{step.name}", *RUN_FILES], ""
    run = remote.parent.parent
    if remote.parent.name == "checkpoints" and (remote / MODEL_JSON).exists() and (run / "config.yaml").exists():
        return run, [f"checkpoints/{remote.name}", *RUN_FILES], f"checkpoints/{remote.name}"
    return remote, [""], ""


def _newest_checkpoint(remote):
    """A run directory's newest committed checkpoints/step-N (the one load_model reads), or None."""
    from ember.checkpoint.run_dir import complete_checkpoints

    checkpoints = remote / "checkpoints"
    if (remote / "model.json").exists() or not checkpoints.is_dir():
        return None
    found = complete_checkpoints(checkpoints)
    return found[-1][1] if found else None


def _listing(root, parts: list[str], url: str, key: str) -> dict[str, list]:
    """relative name -> [size, ETag or mtime] of every object of `parts` under `root` ("" for a single object);
    the first part must hold something, the others (RUN_FILES) may be absent."""
    fs, base = root.fs, root.path.rstrip("/")
    listing = {}
    for index, part in enumerate(parts):
        try:
            found = fs.find(f"{base}/{part}" if part else base, detail=True)
        except FileNotFoundError:
            found = {}
        except Exception as err:
            raise ConfigError(f"{key} {url}: cannot be listed ({first_error_line(err)})") from None
        if not found and index == 0:
            raise UserFileNotFound(f"{key} {url} does not exist (nothing stored under it)")
        for name, info in found.items():
            relative = name[len(base):].lstrip("/")
            if relative and relative.rsplit("/", 1)[-1] in NOT_COPIED:
                continue
            listing[relative] = [info.get("size"),
                                 str(info.get("ETag") or info.get("mtime") or info.get("LastModified"))]
    return listing


def _download(source, listing: dict[str, list], entry: Path, url: str, key: str) -> None:
    needed = sum(size or 0 for size, _ in listing.values())
    limit = cache_limit_bytes()
    if needed > limit:
        stream = "; or read it as it trains: data.streaming=true" if key == "data.dataset" else ""
        given = os.environ.get("EMBER_REMOTE_CACHE_GB", "200")
        raise ConfigError(f"{url} is {_size(needed)}, more than the local cache's bound of {_size(limit)} "
                          f"(EMBER_REMOTE_CACHE_GB={given}); raise it (the disk at {cache_root()} must hold it)"
                          f"{stream}")
    _make_room(needed, keep=entry)
    staging = entry / f"data.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    fs, root = source.fs, source.path.rstrip("/")
    for relative in sorted(listing):  # under the source's own name: a directory, a run, or one file
        target = staging / source.name / relative if relative else staging / source.name
        target.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(f"{root}/{relative}" if relative else root, str(target))
    shutil.rmtree(entry / "data", ignore_errors=True)
    os.replace(staging, entry / "data")  # a copy is whole or absent: a killed download leaves only a partial-* dir
    (entry / MANIFEST).write_text(json.dumps({"url": url, "listing": listing, "bytes": needed}))


def _read_manifest(entry: Path) -> dict:
    try:
        return json.loads((entry / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}


def _touch(entry: Path) -> None:
    (entry / "last-used").write_text(str(time.time()))


def _make_room(needed: int, keep: Path) -> None:
    """Remove the least recently used copies until `needed` more bytes fit under the bound."""
    root, limit = cache_root(), cache_limit_bytes()
    entries = []
    for entry in root.iterdir() if root.is_dir() else []:
        manifest = _read_manifest(entry)
        if entry.is_dir() and manifest and entry != keep:
            used = entry / "last-used"
            entries.append((used.stat().st_mtime if used.exists() else 0.0, manifest.get("bytes", 0), entry))
    total = sum(size for _, size, _ in entries)
    for _, size, entry in sorted(entries):
        if total + needed <= limit:
            break
        with _locked(entry):
            shutil.rmtree(entry, ignore_errors=True)
        total -= size


@contextmanager
def _locked(entry: Path) -> Iterator[None]:
    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{entry}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def local_data(data: DataConfig) -> DataConfig:
    """`data` with each source given as a URL (data.dataset, data.mixture's sources, data.tokenizer) replaced by its
    local copy, for the readers, which read local files; the run's config keeps the URLs. A URL with a glob
    (s3://bucket/shards/*.jsonl) is copied from the prefix before its first wildcard and matched in the copy."""
    def local(spec: Optional[str], key: str) -> Optional[str]:
        if spec is None or not is_url(spec):
            return spec
        if not any(c in spec for c in "*?["):
            return str(local_copy(spec, key))
        head = spec[: min(spec.index(c) for c in "*?[" if c in spec)]
        prefix, _, _ = head.rpartition("/")
        return str(local_copy(prefix, key)) + spec[len(prefix):]

    mixture = [dataclasses.replace(item, source=local(item.source, f"data.mixture[{i}].source"))
               for i, item in enumerate(data.mixture)]
    # data.streaming=true reads its files from the store as it consumes them (ember/data/stream.py): a corpus
    # larger than the cache's bound is never copied whole
    dataset = data.dataset if data.streaming else local(data.dataset, "data.dataset")
    return dataclasses.replace(data, dataset=dataset, tokenizer=local(data.tokenizer, "data.tokenizer"),
                               mixture=mixture)


def remote_files(url: str, suffixes: tuple[str, ...]) -> list[str]:
    """The objects a URL names, sorted, as URLs: one object, a prefix's objects ending in `suffixes`, or a glob's
    matches (what sources.local_files is for a local path)."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    prefix = url[: url.index("://") + 3]
    if any(c in url for c in "*?["):
        files = [f for f in fs.glob(path) if fs.isfile(f)]
        if not files:
            raise UserFileNotFound(f"data.dataset glob '{url}' matches no objects; check the pattern")
    elif fs.isdir(path):
        files = [f for f in fs.find(path) if f.endswith(suffixes)]
        if not files:
            raise DataError(f"data.dataset '{url}' holds no {'/'.join(suffixes)} objects; add some or point elsewhere")
    else:
        files = [path]  # (its existence was checked before any work: location.check_source_url)
    for f in files:
        if not f.endswith(suffixes):
            raise DataError(f"data.dataset object '{prefix}{f}' is not one of {'/'.join(suffixes)}; convert or "
                            "rename it")
    return [prefix + f for f in sorted(files)]
