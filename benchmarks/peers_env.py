"""The environments benchmarks/peers.py's frameworks run in and what it records of them: the peers' own python
(never ember's: litgpt and torchtitan pin libraries that clash with ember's), the peers' versions, and ember's
version and commit."""

from __future__ import annotations

import importlib.metadata
import subprocess
from pathlib import Path
from typing import Optional

from ember.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
SETUP = ("python -m venv .venv-peers && .venv-peers/bin/pip install torch==2.13.0 && "
         ".venv-peers/bin/pip install torch==2.13.0 -r benchmarks/requirements-peers.txt")


def find_peers_python(given: Optional[str], environ: dict[str, str], repo: Path = REPO) -> Path:
    """--peers-python, else $EMBER_PEERS_PYTHON, else the repository's .venv-peers/bin/python."""
    chosen = given or environ.get("EMBER_PEERS_PYTHON") or str(repo / ".venv-peers" / "bin" / "python")
    path = Path(chosen)
    if not path.is_file():
        raise ConfigError(f"no peers environment: {path} does not exist; set one up with `{SETUP}` (or point "
                          "--peers-python or EMBER_PEERS_PYTHON at a python that has litgpt and torchtitan)")
    return path


def peer_versions(recorded: list[str], frameworks: list[str], peers_python: Optional[Path]) -> dict[str, str]:
    """{"litgpt": "0.5.13", ...}: each peer's version as its runs recorded it (`recorded`: "NAME VERSION" texts),
    else (no run of it did: litgpt's rows are all eager, say) as the peers' environment's package metadata gives
    it."""
    versions = dict(text.split(" ", 1) for text in recorded)
    for peer in frameworks:
        if peer in versions or peer == "ember" or peers_python is None:
            continue
        probe = f"from importlib.metadata import version; print(version({peer!r}))"  # as litgpt_run.py says it
        try:
            found = subprocess.run([str(peers_python), "-c", probe], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            continue  # no version is better than a wrong one; the rows are worth more than it
        if found.returncode == 0 and found.stdout.strip():
            versions[peer] = found.stdout.strip()
    return versions


def ember_version() -> Optional[str]:
    """ember's installed version (its package metadata), or None where it is not installed as a package."""
    try:
        return importlib.metadata.version("ember")
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit(repo: Path) -> Optional[str]:
    """`repo`'s HEAD commit, "-dirty" after it where `git status --porcelain` lists anything (the code that ran
    is not the commit's alone); None where git is missing or `repo` is no git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=60)
        status = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True,
                                timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0 or status.returncode != 0:
        return None
    return head.stdout.strip() + ("-dirty" if status.stdout.strip() else "")
