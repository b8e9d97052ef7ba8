"""The style holds without review: `ruff check` (configured in pyproject.toml) passes on ember/, tests/ and
benchmarks/, and no module grows past what one reader takes in (400 lines; the Trainer 350)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_passes():
    assert importlib.util.find_spec("ruff") is not None, "ruff is not installed: pip install -e '.[test]'"
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "ember", "tests", "benchmarks"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"ruff check failed (`ruff check --fix` fixes some):\n{proc.stdout}{proc.stderr}"


def test_no_module_is_too_long():
    lengths = {path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines())
               for folder in ("ember", "tests") for path in (ROOT / folder).rglob("*.py")}
    assert {path: n for path, n in lengths.items() if n > 400} == {}
    assert lengths["ember/train/trainer.py"] <= 350
