"""Writing an output beside its destination and swapping it in: what `ember convert` and `ember data prepare`
write never leaves a half-written destination, and what was there is removed only once the new one is whole."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


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


def remove(path: Path) -> None:
    """A file or a directory tree, if there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
