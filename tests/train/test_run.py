"""ember/train/run.py: the decisions the trainer and the planner share are made by one function each, and both callers
take their answer from it (a rule copied into each drifted within a day)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from ember import config as config_lib
from ember.parallel.mesh import AXES, MeshShape
from ember.train import run as run_lib
from ember.train.trainer import Trainer
from tests.helpers import tiny_model


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


def _tiny(tmp_path: Path, *extra: str, world: int = 1) -> config_lib.JobConfig:
    return run_lib.load_config("debug", ["data.dataset=synthetic", *tiny_model(), "seq_len=16", "global_batch_size=2",
                                         "micro_batch_size=2", "max_steps=1", "metrics.console=false",
                                         f"output_dir={tmp_path}", *extra], world_size=world)


def test_the_trainer_and_the_planner_take_resolves_decisions_and_build_by_build_model(tmp_path: Path, monkeypatch):
    """One resolution and one build path: the trainer's RunSpec is resolve's, the planner's is resolve's for its
    target, and both build through build_model. A decision changed in ember/train/run.py reaches both."""
    from ember.plan import memory as plan_memory
    from ember.plan.planner import make_plan

    resolved, built = [], []
    real_resolve, real_build = run_lib.resolve, run_lib.build_model
    monkeypatch.setattr(run_lib, "uses_loss_parallel", lambda cfg, shape: True)
    monkeypatch.setattr(run_lib, "uses_fsdp_mixed_precision", lambda cfg, shape, dtype: True)

    def resolve(*args, **kwargs):
        resolved.append(real_resolve(*args, **kwargs))
        return resolved[-1]

    def build_model(spec, *args, **kwargs):
        built.append(spec)
        return real_build(spec, *args, **kwargs)

    for module in (run_lib, plan_memory):
        monkeypatch.setattr(module, "resolve", resolve, raising=False)
        monkeypatch.setattr(module, "build_model", build_model, raising=False)
    cfg = _tiny(tmp_path)
    trainer = Trainer(cfg)
    trainer.train_loader.close()
    assert trainer.spec is resolved[0] and built[0] is trainer.spec
    assert trainer.engine.forward_backward.loss_parallel is True and trainer.spec.fsdp_mixed is True
    make_plan(cfg, world=1, device="cpu")
    plan = resolved[1]
    assert plan.parallel.loss_parallel is True and plan.fsdp_mixed is True and len(built) > 1
    # On this machine's CPU the plan's spec is the trainer's, decision for decision.
    assert dataclasses.replace(plan, device=trainer.spec.device) == trainer.spec


def test_resolve_decides_from_the_config_and_the_device(tmp_path: Path):
    cfg = _tiny(tmp_path, "micro_batch_size=1", "parallel.cp_impl=auto", "precision=bf16", world=2)
    on_cpu = run_lib.resolve(cfg, 2, torch.device("cpu"))
    assert (on_cpu.shape.degree("fsdp"), on_cpu.grad_accum, on_cpu.compute_dtype) == (2, 1, torch.bfloat16)
    assert on_cpu.fsdp_mixed and on_cpu.autocast_dtype is None and on_cpu.parallel.param_dtype == torch.bfloat16
    assert on_cpu.parallel.cp_impl == "allgather" and on_cpu.tokens_per_step == 32
    planned = run_lib.resolve(cfg, 2, torch.device("cuda"), compute_dtype=torch.bfloat16)
    assert planned.parallel.cp_impl == "ring"  # auto: ring attention on CUDA
    one = run_lib.resolve(_tiny(tmp_path, "precision=fp32", "micro_batch_size=1"), 1, torch.device("cpu"))
    assert not one.fsdp_mixed and one.autocast_dtype is None and one.grad_accum == 2
    with pytest.raises(config_lib.ConfigError, match="cp_impl=ring needs CUDA"):
        run_lib.resolve(_tiny(tmp_path, "ici_mesh.context=2", "ici_mesh.fsdp=1", "parallel.cp_impl=ring", world=2),
                        2, torch.device("cpu"))


@pytest.mark.parametrize("family", ["llama3", "gemma3", "qwen3", "mistral"])
def test_run_json_counts_flops_per_token_as_an_int_for_every_family(family: str):
    # gemma3, qwen3 and mistral count attention through a mean span (a float); llama3 through whole ints
    cfg = config_lib.load("debug", [f"model.family={family}", "model.flavor=debug"])
    spec = run_lib.resolve(cfg, 1, torch.device("cpu"))
    recorded = spec.describe()["flops_per_token"]
    assert type(recorded) is int and recorded == round(spec.flops_per_token)
