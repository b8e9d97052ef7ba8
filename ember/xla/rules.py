"""The XLA engine's rules (ember/train/engines.py's registry entry for device=tpu|xla): the world (every jax device of
every host), the mesh with what the engine refuses (ember/xla/checks.py), the model checks, the compute dtype.
Imports no jax and no torch until a rule is called."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from ember.config_schema import JobConfig
from ember.errors import ConfigError
from ember.parallel.mesh_shape import MeshShape
from ember.train.engines import EngineRules, mesh_shape
from ember.xla import checks

if TYPE_CHECKING:
    import torch

    from ember.nn.args import DecoderArgs


def xla_compute_dtype(precision: str, device: str) -> "torch.dtype":
    """precision on the XLA path: auto is bf16 on TPUs (their matmul units are bf16) and fp32 elsewhere."""
    import torch

    if precision in ("bf16", "fp8") or (precision == "auto" and device == "tpu"):
        return torch.bfloat16
    return torch.float32


def layout(cfg: JobConfig, world_size: int) -> MeshShape:
    """The mesh of `world_size` jax devices, with what this path does not run refused first (a pipeline degree
    changes the device count a mesh error would name)."""
    refuse(cfg, None)
    try:
        shape = mesh_shape(cfg, world_size)
    except ConfigError as err:
        raise ConfigError(checks.mesh_error(str(err), cfg.device, world_size)) from None
    refuse(cfg, shape)
    return shape


def refuse(cfg: JobConfig, shape: Optional[MeshShape]) -> None:
    """What this path does not run: a pipeline degree (from the config alone, before the degrees are multiplied),
    then the mesh's axes against the config (ember/xla/checks.py)."""
    if shape is None:
        checks.refuse_pipeline(cfg)
    else:
        checks.check(cfg, shape)


def check_model(cfg: JobConfig, shape: MeshShape, args: "DecoderArgs") -> None:
    checks.check_scan(cfg, args)
    checks.check_score_bias(cfg, args)


def _world_size(cfg: JobConfig) -> int:
    from ember.xla import runtime

    return runtime.device_count(cfg.device)


RULES = EngineRules(name="xla", engine="ember.xla.engine:XlaEngine", world_size=_world_size, layout=layout,
                    refuse=refuse, check_model=check_model, compute_dtype=xla_compute_dtype, torch_device_checks=False,
                    whole_logits=True)
