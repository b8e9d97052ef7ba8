"""Training-health guards: non-finite steps are skipped, too many in a row stop the run with a
checkpoint of the last good weights; loss spikes are reported with the data position."""

from pathlib import Path

import pytest
import torch

from ember.train import run as run_lib, step as step_lib
from ember.train.trainer import Trainer, TrainingStopped
from tests.helpers import read_records, tiny_model

SMALL = ["data.dataset=synthetic", *tiny_model(), "model.vocab_size=256", "seq_len=16", "global_batch_size=2",
         "micro_batch_size=2", "logging_steps=1", "metrics.console=false", "eval_batches=1"]


def _trainer(tmp_path: Path, *overrides: str) -> Trainer:
    return Trainer(run_lib.load_config("debug", SMALL + [f"output_dir={tmp_path}", *overrides]))


def _poison(monkeypatch: pytest.MonkeyPatch, trainer: Trainer, steps: set[int], factor: float) -> None:
    """The loss times `factor` at `steps`, whether the step computes it from logits or fused with the output
    projection (one process: the fused path)."""
    for name in ("token_loss_sum", "linear_cross_entropy_sum"):
        original = getattr(step_lib, name)

        def scaled(*args, original=original, **kwargs):
            loss = original(*args, **kwargs)
            return loss * factor if trainer.step + 1 in steps else loss

        monkeypatch.setattr(step_lib, name, scaled)


def test_non_finite_steps_are_skipped_without_touching_the_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    trainer = _trainer(tmp_path, "max_steps=6")
    _poison(monkeypatch, trainer, {3, 4}, float("nan"))
    snapshots = {}
    original_step = trainer.train_step

    def recording(batches):
        out = original_step(batches)
        snapshots[trainer.step + 1] = trainer.model.output.weight.detach().clone()
        return out

    monkeypatch.setattr(trainer, "train_step", recording)
    summary = trainer.train()
    assert summary["skipped_steps"] == 2 and summary["steps"] == 6
    assert torch.equal(snapshots[2], snapshots[3]) and torch.equal(snapshots[3], snapshots[4])  # no update
    assert not torch.equal(snapshots[4], snapshots[5])  # training goes on after them
    assert torch.isfinite(trainer.model.output.weight).all()


def test_too_many_in_a_row_stop_with_a_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    trainer = _trainer(tmp_path, "max_steps=20", "max_skipped_steps=2")
    _poison(monkeypatch, trainer, set(range(4, 21)), float("inf"))
    with pytest.raises(TrainingStopped,
                       match=r"3 steps in a row had a non-finite loss or grad norm \(max_skipped_steps=2\)"):
        trainer.train()
    state = torch.load(tmp_path / "checkpoints" / "step-6" / "train-rank0.pt", weights_only=True)
    assert state["step"] == 6 and state["skipped_in_a_row"] == 3


@pytest.mark.slow
def test_loss_spike_is_reported_with_its_data_position(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    trainer = _trainer(tmp_path, "max_steps=16", "loss_spike_factor=3")
    _poison(monkeypatch, trainer, {14}, 10.0)
    trainer.train()
    spikes = [r for r in read_records(tmp_path) if "loss_spike" in r]
    assert [r["step"] for r in spikes] == [14]
    assert spikes[0]["data_position"] == {"epoch": 0, "cursor": 28}  # 14 steps x 2 samples read so far
