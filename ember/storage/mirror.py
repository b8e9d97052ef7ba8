"""A remote output_dir's small files, kept in a local folder and uploaded at checkpoints and at the end.

Checkpoints go straight to the object store (DCP through fsspec, ember/checkpoint/manager.py). What else a run
writes there (metrics.jsonl appended every logging step, TensorBoard's event files, config.yaml, run.json,
config_history/, profiles) is written by code that appends and renames, which object stores cannot do; so it
is written into a local mirror of the run (EMBER_CACHE/runs/<hash of the URL>/), pulled from the store when the
run starts and pushed back, file by file where it changed, after each committed checkpoint and when the run
ends. A run killed between two checkpoints loses the metrics since the last push, as a resume would retrain
those steps anyway.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from ember.constants import default_cache_dir
from ember.storage.location import Location, as_path, is_url

# Not mirrored: the checkpoints (written to the store directly) and other runs' moved-aside checkpoints.
REMOTE_ONLY = ("checkpoints",)


def local_run_dir(output_dir: str) -> Path:
    """Where this host writes the run's files: output_dir itself, or for a URL its local mirror."""
    if not is_url(output_dir):
        return as_path(output_dir)
    return default_cache_dir() / "runs" / hashlib.sha256(output_dir.rstrip("/").encode()).hexdigest()[:16]


@dataclass
class RunMirror:
    """The local mirror of a remote output_dir and what of it has been uploaded: (size, mtime) per file."""

    remote: Location
    local: Path
    pushed: dict[str, tuple[int, int]] = field(default_factory=dict)

    def pull(self) -> None:
        """Replace the local mirror with the store's files of the run (all but the checkpoints)."""
        import shutil

        shutil.rmtree(self.local, ignore_errors=True)
        self.local.mkdir(parents=True)
        if not self.remote.exists():
            return
        fs, root = self.remote.fs, self.remote.path.rstrip("/")
        for path in fs.find(root):
            relative = path[len(root) + 1:]
            if not relative or _remote_only(relative):
                continue
            target = self.local / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(path, str(target))
            self.pushed[relative] = _signature(target)

    def push(self) -> None:
        """Upload every file that changed since the last push; delete from the store the run's files that were
        moved away locally (a run started over moves the previous run's aside)."""
        fs, root = self.remote.fs, self.remote.path.rstrip("/")
        present: set[str] = set()
        for target in sorted(p for p in self.local.rglob("*") if p.is_file()):
            relative = target.relative_to(self.local).as_posix()
            present.add(relative)
            signature = _signature(target)
            if self.pushed.get(relative) != signature:
                fs.put_file(str(target), f"{root}/{relative}")
                self.pushed[relative] = signature
        for relative in sorted(set(self.pushed) - present):
            try:
                fs.rm_file(f"{root}/{relative}")
            except FileNotFoundError:
                pass
            del self.pushed[relative]


def _remote_only(relative: str) -> bool:
    first = relative.split("/", 1)[0]
    return first in REMOTE_ONLY or (first.startswith("previous-") and "/checkpoints/" in f"/{relative}")


def _signature(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns
