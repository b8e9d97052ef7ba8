"""The two environments benchmarks/maxtext_peer.py runs: MaxText's (its own virtual environment, Python >= 3.12)
and ember's (this interpreter, or --ember-python), found, checked and their versions read."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
SETUP = ("python3.12 -m venv .venv-maxtext && .venv-maxtext/bin/pip install -r "
         "benchmarks/requirements-maxtext.txt")


def find_maxtext_python(given: Optional[str], environ: dict[str, str], repo: Path = ROOT) -> Path:
    """--maxtext-python, else $EMBER_MAXTEXT_PYTHON, else the repository's .venv-maxtext/bin/python."""
    source = ("--maxtext-python " if given else "EMBER_MAXTEXT_PYTHON=" if environ.get("EMBER_MAXTEXT_PYTHON")
              else "")
    path = Path(given or environ.get("EMBER_MAXTEXT_PYTHON") or repo / ".venv-maxtext" / "bin" / "python")
    if not path.is_file() or not os.access(path, os.X_OK):
        what = "is not an executable file" if path.exists() else "does not exist"
        raise SystemExit(f"no MaxText environment: {source}{path} {what}; set one up with `{SETUP}` (or point "
                         "--maxtext-python or EMBER_MAXTEXT_PYTHON at a python that has maxtext)")
    return path


def base_yml(python: Path) -> str:
    """MaxText's configs/base.yml in its environment."""
    probe = "import maxtext, os; print(os.path.join(os.path.dirname(maxtext.__file__), 'configs', 'base.yml'))"
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{python} cannot import maxtext ({(done.stderr.strip().splitlines() or ['?'])[-1]}); "
                         f"set its environment up with `{SETUP}`")
    return done.stdout.strip()


def versions(python: str | Path, packages: tuple[str, ...], names: tuple[str, ...]) -> dict[str, str]:
    """`packages`' versions in the environment of `python`, under `names`."""
    probe = f"from importlib.metadata import version as v; print(*(v(p) for p in {packages!r}), sep='\\n')"
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    return dict(zip(names, done.stdout.split())) if done.returncode == 0 else {}


def maxtext_versions(python: Path) -> dict[str, str]:
    return versions(python, ("maxtext", "jax", "jaxlib"), ("maxtext", "maxtext_jax", "maxtext_jaxlib"))


def ember_versions(python: str) -> dict[str, str]:
    """The ember side's jax, torchax and torch, read from its own interpreter (--ember-python)."""
    found = versions(python, ("jax", "torchax", "torch"), ("jax", "torchax", "torch"))
    if len(found) != 3:
        raise SystemExit(f"--ember-python {python} cannot read jax, torchax and torch's versions: install ember's "
                         "tpu extra there (pip install -e '.[tpu]')")
    return found
