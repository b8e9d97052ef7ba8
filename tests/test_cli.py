"""The `ember` command itself: help, recipes table, unknown commands."""

import subprocess
import sys


def _ember(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ember", *args], capture_output=True, text=True, timeout=120)


def test_recipes_table_lists_parameter_counts():
    proc = _ember("recipes")
    assert proc.returncode == 0, proc.stderr
    for text in ("llama3.1-405b", "405,853,388,800", "70,553,706,496", "1,235,814,400", "debug", "8192", "1024"):
        assert text in proc.stdout


def test_unknown_command_and_recipe_are_one_line_errors():
    proc = _ember("trian")
    assert proc.returncode == 2 and proc.stderr.startswith("error: unknown command 'trian'")
    proc = _ember("train", "llama3-8")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "did you mean 'llama3-8b'" in proc.stderr
    assert _ember("train", "--help").returncode == 0
