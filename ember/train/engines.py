"""Which engine a run trains on, by `device`, and what each engine asks of a config before any work.

An engine is the part of training that differs between runtimes: where the weights live, the step, the
evaluation forward, the reductions and the state a checkpoint saves. ember/train/trainer.py's one Trainer owns the rest
(data, health, metrics, evaluation, profiling, checkpoints) for every engine. Two are registered:
- torch.distributed (ember/train/torch_engine.py: TorchEngine) for device=auto|cpu|cuda;
- XLA SPMD through torchax and jax (ember/xla/engine.py: XlaEngine) for device=tpu|xla, whose rules live in
  ember/xla/rules.py (they import no jax).
A third engine is a module with its Engine class, its EngineRules, and one entry in ENGINES.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from ember.config_schema import JobConfig
from ember.errors import ConfigError
from ember.parallel.mesh_shape import MeshError, MeshShape, resolve_mesh

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class EngineRules:
    """What ember.train.run asks of an engine, from the config alone (no devices are touched, no jax is imported)."""

    name: str
    engine: str  # "module:Class" of the engine the Trainer builds
    world_size: Callable[[JobConfig], int]  # this machine's devices, where the config does not say
    layout: Callable[[JobConfig, int], MeshShape]  # the mesh for a world, with this engine's refusals
    # what the engine refuses of the config alone (shape None) and of a mesh: what `layout` checks, for the
    # launchers that make the mesh themselves (ember launch xpk|tpu-vm: chips x slices)
    refuse: Callable[[JobConfig, Optional[MeshShape]], None]
    check_model: Callable[[JobConfig, MeshShape, Any], None]  # the model and layout against what the engine runs
    # precision -> compute dtype, where the engine decides without measuring (None: ember.hardware.device's rules)
    compute_dtype: Optional[Callable[[str, str], "torch.dtype"]]
    torch_device_checks: bool  # ember.train.run.check_device_options applies (options that need a torch device)
    whole_logits: bool  # the loss takes a micro-batch's whole logits (no chunked or fused output loss)


def mesh_shape(cfg: JobConfig, world_size: int) -> MeshShape:
    """The resolved ici x dcn degrees for `world_size` processes, or a ConfigError naming the numbers."""
    try:
        return resolve_mesh(cfg.ici_mesh, cfg.dcn_mesh, world_size)
    except MeshError as err:
        raise ConfigError(str(err)) from None


def _torch_check_model(cfg: JobConfig, shape: MeshShape, args: Any) -> None:
    """What the torch engine does not run with this layout: eval.tasks score on each rank's whole model."""
    if cfg.eval.tasks and any(shape.degree(a) > 1 for a in ("tensor", "pipeline", "context")):
        raise ConfigError("eval.tasks run the whole model on every rank: they work with the data, fsdp and expert "
                          "axes; use `ember eval` on the checkpoint for tensor, pipeline or context layouts")


def _refuse_nothing(cfg: JobConfig, shape: Optional[MeshShape]) -> None:
    """The torch engine runs every layout a mesh resolves to (ember/parallel/checks.py checks it against the model)."""


TORCH = EngineRules(name="torch.distributed", engine="ember.train.torch_engine:TorchEngine",
                    world_size=lambda cfg: 1, layout=mesh_shape, refuse=_refuse_nothing, check_model=_torch_check_model,
                    compute_dtype=None, torch_device_checks=True, whole_logits=False)

# device -> "module:attribute" of its EngineRules; every other device trains on TORCH
ENGINES: dict[str, str] = {"tpu": "ember.xla.rules:RULES", "xla": "ember.xla.rules:RULES"}


def _attribute(path: str) -> Any:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def rules(device: str) -> EngineRules:
    """The rules of the engine `device` trains on."""
    return _attribute(ENGINES[device]) if device in ENGINES else TORCH


def engine_type(device: str) -> type:
    """The Engine class `device` trains on (its module imported now: the XLA one brings jax)."""
    return _attribute(rules(device).engine)
