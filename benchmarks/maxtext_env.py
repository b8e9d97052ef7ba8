"""The two environments benchmarks/maxtext_peer.py runs, MaxText's (its own virtual environment, Python >= 3.12)
and ember's (this interpreter, or --ember-python), found, checked and their versions read; and its results file,
checked writable (and mergeable) before any run."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
SETUP = ("python3.12 -m venv .venv-maxtext && .venv-maxtext/bin/pip install -r "
         "benchmarks/requirements-maxtext.txt")


def find_maxtext_python(given: Optional[str], environ: dict[str, str], repo: Path = ROOT) -> Path:
    """--maxtext-python, else $EMBER_MAXTEXT_PYTHON, else the repository's .venv-maxtext/bin/python."""
    source = ("--maxtext-python " if given else "EMBER_MAXTEXT_PYTHON=" if environ.get("EMBER_MAXTEXT_PYTHON")
              else "")
    # absolute, not resolved: the runs start in the repository root, and a venv's python is a link out of it
    path = Path(os.path.abspath(given or environ.get("EMBER_MAXTEXT_PYTHON")
                                or repo / ".venv-maxtext" / "bin" / "python"))
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
    """`packages`' versions in the environment of `python`, under `names`, and its Python's as "python"; {} where
    that interpreter cannot run or lacks one of them."""
    probe = ("import platform; from importlib.metadata import version as v; "
             f"print(platform.python_version(), *(v(p) for p in {packages!r}), sep='\\n')")
    try:
        done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    except OSError:
        return {}
    found = done.stdout.split()
    return dict(zip(("python", *names), found)) if done.returncode == 0 and len(found) == len(names) + 1 else {}


def maxtext_versions(python: Path) -> dict[str, str]:
    found = versions(python, ("maxtext", "jax", "jaxlib"), ("maxtext", "maxtext_jax", "maxtext_jaxlib"))
    return {("maxtext_python_version" if k == "python" else k): v for k, v in found.items()}


def ember_versions(given: Optional[str], default: str) -> tuple[str, str, dict[str, str]]:
    """ember's side: --ember-python as an absolute path (the runs start in the repository root), as the results
    file names it (inside the repository relative to it, "python" for this interpreter), and its Python, ember,
    jax, torchax and torch versions ("ember_jax", ...); one line where it is not such an interpreter."""
    python = os.path.abspath(given) if given else default
    shown = "python" if not given else os.path.relpath(python, ROOT) if python.startswith(f"{ROOT}{os.sep}") else python
    named = f"--ember-python {given}" if given else f"this interpreter ({default})"
    if not os.path.isfile(python) or not os.access(python, os.X_OK):
        raise SystemExit(f"{named} is not an executable file: give a python with ember's tpu extra")
    found = versions(python, ("ember", "jax", "torchax", "torch"), ("ember", "jax", "torchax", "torch"))
    if not found:
        raise SystemExit(f"{named} has no ember, jax, torchax or torch: install ember's tpu extra there "
                         "(pip install -e '.[tpu]')")
    return python, shown, {("ember_python_version" if k == "python" else "ember_version" if k == "ember"
                            else f"ember_{k}"): v for k, v in found.items()}


def results_path(args: Any) -> Path:
    return args.out / f"maxtext_peer{'-' + args.tag if args.tag else ''}-cpu.json"


def check_writable(path: Path, args: Any) -> None:
    """The results file can be written (and, with --merge, merged with): said now, before hours of runs."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe = path.with_name(f".{path.name}.{os.getpid()}.probe")
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise SystemExit(f"--out {args.out}: cannot write {path.name} there ({err.strerror or err})") from None
    if args.merge:
        earlier_rows(path, args)


def earlier_rows(path: Path, args: Any, flag: str = "--merge") -> list[dict[str, Any]]:
    """--merge or --replan (`flag`): the rows of `path`, refused where it is no results file of this benchmark or its
    figures are another ember environment's (a row's versions are its file's)."""
    if not path.exists():
        if flag == "--replan":
            raise SystemExit(f"--replan: there is no {path}: measure its rows first (without --replan), or give the "
                             "--tag and --out of a results file")
        return []
    try:
        earlier = json.loads(path.read_text())
        rows, theirs = earlier["rows"], {k: earlier.get(k) for k in ("ember_jax", "ember_torchax")}
    except (json.JSONDecodeError, KeyError, TypeError, OSError):
        fix = "give the --tag and --out of one" if flag == "--replan" else "move it away or drop --merge"
        raise SystemExit(f"{flag}: {path} is not a results file of this benchmark; {fix}") from None
    ours = {k: args.ember[k] for k in theirs}
    if theirs != ours:
        fix = ("give the --ember-python its rows were measured with" if flag == "--replan"
               else "give another --tag")
        raise SystemExit(f"{flag}: {path} holds figures of ember on {theirs}, this run's is {ours}; {fix}")
    return rows
