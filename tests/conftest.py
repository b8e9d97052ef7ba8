"""Fixtures shared across the suite."""

import subprocess
import time
from pathlib import Path
from typing import Callable

import pytest


def _wait_for_logged_step(proc: subprocess.Popen, metrics: Path, ceiling_s: float = 600) -> None:
    """Wait until a training subprocess has logged its first step (its loop then runs with its signal handlers
    installed). The ceiling only bounds a hang: a loaded machine is slow to get there, never wrong."""
    deadline = time.monotonic() + ceiling_s
    while '"loss"' not in (metrics.read_text() if metrics.is_file() else ""):
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, "the run logged no step"
        time.sleep(0.05)


@pytest.fixture
def wait_for_logged_step() -> Callable[..., None]:
    return _wait_for_logged_step
