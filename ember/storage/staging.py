"""Writing an output beside its destination and swapping it in: what `ember convert` and `ember data prepare`
write never leaves a half-written destination, and what was there is removed only once the new one is whole.
A destination on an object store (a URL) is written locally first and then uploaded the same way (staged_at)."""

from __future__ import annotations

import hashlib
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ember.storage.location import Location, move, remove_tree


@contextmanager
def staged(dst: Path, tag: str, directory: bool = False) -> Iterator[Path]:
    """A path beside `dst` (`.NAME.TAG-new`; created as a directory with `directory`) to write into. On success it
    replaces `dst`, whose old file or directory is removed only then; on failure it is removed and `dst` is left
    as it was. Leftovers of an interrupted run with the same tag are removed first."""
    target = Path(dst).resolve()  # "." and "shards/" have a name once resolved
    target.parent.mkdir(parents=True, exist_ok=True)
    stage, old = (target.with_name(f".{target.name}.{tag}-{kind}") for kind in ("new", "old"))
    for leftover in (stage, old):
        remove(leftover)
    if directory:
        stage.mkdir()
    try:
        yield stage
    except BaseException:
        remove(stage)
        raise
    if target.exists():
        os.replace(target, old)
    os.replace(stage, target)
    remove(old)


@contextmanager
def staged_at(dst: Location, tag: str, directory: bool = False, markers: tuple[str, ...] = ()) -> Iterator[Path]:
    """staged() for a local `dst`; for one on an object store, a local path to write into (under EMBER_CACHE/
    uploads/, named as `dst`), uploaded on success by `upload` (`markers`: the directory's commit marker, moved
    last) and removed either way; on failure nothing on the store changes."""
    if isinstance(dst, Path):
        with staged(dst, tag, directory) as stage:
            yield stage
        return
    from ember.constants import default_cache_dir

    url = str(dst).rstrip("/")
    folder = default_cache_dir() / "uploads" / f"{hashlib.sha256(url.encode()).hexdigest()[:16]}-{os.getpid()}"
    remove(folder)
    folder.mkdir(parents=True)
    stage = folder / (dst.name or "output")
    if directory:
        stage.mkdir()
    try:
        yield stage
        upload(stage, dst, tag, markers)
    finally:
        remove(folder)


def upload(local: Path, dst: Location, tag: str, markers: tuple[str, ...] = ()) -> None:
    """Put a local file or directory at `dst` on an object store, replacing what is there, never half-written.

    A file is one PUT, which a store applies whole or not at all. A directory is uploaded to `.NAME.TAG-new`
    beside `dst` and then moved in, rather than uploaded into `dst` with the old objects removed after: the upload
    is the long part, the one that fails (the network, a killed process, a quota), and beside `dst` a failure
    leaves `dst` as it was, the partial prefix removed here or by the next try; uploaded into `dst` it would mix
    the old model's objects with the new one's, which can load as wrong weights. The move is server-side copies
    (no data through this host): the old `dst` is removed only once the new one is whole on the store, and the
    commit markers (`markers`: model.json, config.json) are copied last, so while it runs `dst` lacks its marker
    and no reader takes it for a model."""
    fs, target = dst.fs, dst.path.rstrip("/")
    if local.is_file():
        fs.put_file(str(local), target)
        return
    stage = dst.parent / f".{dst.name}.{tag}-new"
    remove_tree(stage)
    root = stage.path.rstrip("/")
    try:
        for file in sorted(p for p in local.rglob("*") if p.is_file()):
            fs.put_file(str(file), f"{root}/{file.relative_to(local).as_posix()}")
    except BaseException:
        try:
            remove_tree(stage)
        except Exception:  # the store unreachable now too: the next upload removes it; the first error is the one
            pass
        raise
    remove_tree(dst)
    move(stage, dst, last=markers)


def remove(path: Path) -> None:
    """A file or a directory tree, if there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
