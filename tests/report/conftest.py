"""Short real runs shared by the report tests (trained once per session, each a few seconds on two cores)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Callable

import pytest

from ember.cli import main
from tests.helpers import tiny_model

TINY = [*tiny_model(), "seq_len=32", "global_batch_size=2", "micro_batch_size=2", "logging_steps=2",
        "metrics.tensorboard=false"]


def _train(output_dir: Path, *overrides: str, recipe: str = "debug") -> str:
    """`ember train` in this process; returns what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["train", recipe, *TINY, f"output_dir={output_dir}", *overrides]) == 0
    return out.getvalue()


@pytest.fixture(scope="session")
def train() -> Callable[..., str]:
    """train(output_dir, *overrides): a tiny `ember train` in this process; returns what it printed."""
    return _train


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """20 steps, validation at 10 and 20, checkpoints at 10 and 20; (run dir, console output)."""
    run = tmp_path_factory.mktemp("report") / "tiny"
    printed = _train(run, "max_steps=20", "eval_interval=10", "checkpoint.interval=10", "checkpoint.keep=0")
    return run, printed
