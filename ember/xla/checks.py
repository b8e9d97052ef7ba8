"""What the XLA path (device=tpu|xla) does not run, refused before any work with one line naming the key.
Imports no jax: ember.run.check calls it with the config."""

from __future__ import annotations

from ember.config import fp8_enabled
from ember.config_schema import JobConfig
from ember.errors import ConfigError
from ember.parallel.mesh_shape import MeshShape

PIPELINE_REFUSED = ("{where} has no pipeline parallelism (XLA shards layers with fsdp/tensor instead); set "
                    "ici_mesh.pipeline=1 and dcn_mesh.pipeline=1")


def mesh_shape(cfg: JobConfig, devices: int) -> MeshShape:
    """The run's mesh over jax's devices, its error worded for them (and how to get more on a CPU)."""
    from ember.run import mesh_shape as run_mesh_shape

    if cfg.ici_mesh.pipeline > 1 or cfg.dcn_mesh.pipeline > 1:  # refused first: it also changes the device count
        raise ConfigError(PIPELINE_REFUSED.format(where=f"device={cfg.device}"))
    try:
        return run_mesh_shape(cfg, devices)
    except ConfigError as err:
        more = ("; on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N JAX_PLATFORMS=cpu makes N devices"
                if cfg.device == "xla" else "")
        raise ConfigError(str(err).replace("the number of processes", f"jax's {devices} device(s)") + more) from None


def check(cfg: JobConfig, shape: MeshShape) -> None:
    where = f"device={cfg.device}"
    if shape.degree("pipeline") > 1:
        raise ConfigError(PIPELINE_REFUSED.format(where=where))
    refused = [
        (cfg.task != "lm", f"task={cfg.task}", "task=lm, or train DPO on cpu/cuda"),
        (cfg.lora.rank > 0, "lora.rank", "lora.rank=0, or fine-tune with LoRA on cpu/cuda"),
        (bool(cfg.eval.tasks), "eval.tasks", "eval.tasks=[] and score the checkpoint with `ember eval`"),
        (fp8_enabled(cfg), "precision=fp8 (fp8.enabled)", "precision=bf16"),
        (cfg.model.remat == "offload" and cfg.device != "tpu", "model.remat=offload (it needs a TPU's pinned "
         "host memory)", "model.remat=full"),
    ]
    for refused_here, key, fix in refused:
        if refused_here:
            raise ConfigError(f"{key} is not supported with {where}; use {fix}")
    if cfg.model.scan_layers and cfg.model.remat == "selective":
        raise ConfigError("model.scan_layers=true runs every block alike, so model.remat=selective (every "
                          "remat_every-th block) cannot apply; use model.remat=full or none")
    if cfg.model.scan_layers and cfg.model.family == "glam":
        raise ConfigError("model.scan_layers=true needs every block alike, and glam alternates dense and MoE blocks; "
                          "drop model.scan_layers")
