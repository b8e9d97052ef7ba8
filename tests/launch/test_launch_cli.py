"""`ember launch`'s command line: help, and one-line errors before anything is started or submitted."""

from __future__ import annotations

import subprocess
import sys


def _ember(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ember", *args], capture_output=True, text=True, timeout=120)


def test_help_and_one_line_errors(tmp_path):
    for argv in (["launch", "--help"], ["launch", "slurm", "--help"], ["launch", "k8s", "--help"],
                 ["launch", "local", "--help"]):
        proc = _ember(*argv)
        assert proc.returncode == 0 and "usage: ember launch" in proc.stdout, argv
    # The config is checked for nodes x processes: 3 processes cannot hold tensor=2.
    proc = _ember("launch", "local", "--nproc-per-node", "3", "debug", "ici_mesh.tensor=2")
    assert proc.returncode == 2 and proc.stderr.startswith("error: the world size 3") and proc.stderr.count("\n") == 1
    proc = _ember("launch", "slurm", "debug", "--nodes", "3", "--nproc-per-node", "1", f"output_dir={tmp_path}",
                  "--dry-run")
    assert proc.returncode == 2 and "global_batch_size" in proc.stderr and proc.stderr.count("\n") == 1
    assert not (tmp_path / "launch").exists()  # nothing written
    proc = _ember("launch", "slurm", "debug", "--nodes", "0")
    assert proc.returncode == 2 and "--nodes must be >= 1" in proc.stderr
