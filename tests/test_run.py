"""ember/run.py: the decisions the trainer and the planner share are made by one function each, and both callers
take their answer from it (a rule copied into each drifted within a day)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from ember import config as config_lib
from ember import run as run_lib
from ember.parallel.mesh import AXES, MeshShape
from ember.plan.memory import Job
from ember.train import Trainer


def _shape(**degrees: int) -> MeshShape:
    return MeshShape(ici={axis: degrees.get(axis, 1) for axis in AXES}, dcn={axis: 1 for axis in AXES})


def _cfg(task: str = "lm", loss_parallel: bool = True, mixed_precision: bool = True) -> config_lib.JobConfig:
    cfg = config_lib.JobConfig(task=task)
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, loss_parallel=loss_parallel,
                                                                 mixed_precision=mixed_precision))


@pytest.mark.parametrize("cfg, shape, expected", [
    (_cfg(), _shape(tensor=2), True),
    (_cfg(), _shape(tensor=2, fsdp=4), True),
    (_cfg(), _shape(fsdp=2), False),  # no tensor axis: the logits are whole
    (_cfg(loss_parallel=False), _shape(tensor=2), False),
    (_cfg(), _shape(tensor=2, pipeline=2), False),
    (_cfg(task="dpo"), _shape(tensor=2), False),  # DPO sums each row's log-probabilities from whole logits
])
def test_uses_loss_parallel(cfg, shape, expected):
    assert run_lib.uses_loss_parallel(cfg, shape) is expected


@pytest.mark.parametrize("cfg, shape, dtype, expected", [
    (_cfg(), _shape(fsdp=2), torch.bfloat16, True),
    (_cfg(), _shape(context=2), torch.bfloat16, True),  # context ranks share the FSDP group
    (_cfg(), _shape(tensor=2), torch.bfloat16, False),  # nothing for FSDP to reduce over
    (_cfg(), _shape(fsdp=2), torch.float32, False),
    (_cfg(mixed_precision=False), _shape(fsdp=2), torch.bfloat16, False),
])
def test_uses_fsdp_mixed_precision(cfg, shape, dtype, expected):
    assert run_lib.uses_fsdp_mixed_precision(cfg, shape, dtype) is expected


def test_the_trainer_and_the_planner_both_take_the_functions_answer(tmp_path: Path, monkeypatch):
    """One process, where the real answer is False for both: each caller must report what the function says."""
    asked: list[str] = []

    def loss_parallel(cfg, shape):
        asked.append("loss_parallel")
        return True

    def fsdp_mixed(cfg, shape, dtype):
        asked.append("fsdp_mixed")
        return True

    cfg = config_lib.load("debug", ["data.dataset=synthetic", "model.n_layers=1", "model.dim=64", "model.n_heads=4",
                                    "model.n_kv_heads=2", "seq_len=16", "global_batch_size=2", "micro_batch_size=2",
                                    "max_steps=1", "metrics.console=false", f"output_dir={tmp_path}"])
    shape = config_lib.mesh_shape(cfg, 1)
    job = Job(cfg, config_lib.model_choice(cfg).args, shape, torch.bfloat16, "cpu")
    assert (job.loss_parallel, job.fsdp_mixed) == (False, False)
    monkeypatch.setattr(run_lib, "uses_loss_parallel", loss_parallel)
    monkeypatch.setattr(run_lib, "uses_fsdp_mixed_precision", fsdp_mixed)
    assert (job.loss_parallel, job.fsdp_mixed) == (True, True)
    assert asked == ["loss_parallel", "fsdp_mixed"]
    asked.clear()
    trainer = Trainer(cfg)
    trainer.train_loader.close()
    assert sorted(asked) == ["fsdp_mixed", "loss_parallel"]
    assert trainer.forward_backward.loss_parallel is True and trainer.fsdp_mixed is True
