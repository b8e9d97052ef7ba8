"""The end-of-run line says exactly what it averaged: never more steps than ran, never steps of another run."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from ember.train import run as run_lib
from ember.train.trainer import Trainer
from tests.helpers import tiny_model

TINY = [*tiny_model(), "seq_len=32", "global_batch_size=2", "micro_batch_size=2", "data.dataset=synthetic",
        "eval_batches=1"]


def _run(tmp_path: Path, *overrides: str) -> tuple[dict, str]:
    out = io.StringIO()
    cfg = run_lib.load_config("debug", TINY + [f"output_dir={tmp_path}", *overrides])
    summary = Trainer(cfg, console=Console(file=out, width=400, soft_wrap=True)).train()
    return summary, out.getvalue()


def test_fewer_steps_than_the_logging_window(tmp_path: Path):
    summary, text = _run(tmp_path, "max_steps=5", "logging_steps=10")
    assert summary["final_loss_steps"] == [1, 5]
    assert "(step 1) ->" in text and "(mean of steps 1-5)" in text and "last 10" not in text


@pytest.mark.slow
def test_a_resumed_run_averages_its_own_last_steps(tmp_path: Path):
    _run(tmp_path, "max_steps=4", "logging_steps=3")
    summary, text = _run(tmp_path, "max_steps=9", "logging_steps=3")
    assert summary["final_loss_steps"] == [7, 9] and "(step 5) ->" in text and "(mean of steps 7-9)" in text
    summary, text = _run(tmp_path, "max_steps=10", "logging_steps=3")
    assert summary["final_loss_steps"] == [10, 10] and "(step 10)" in text
