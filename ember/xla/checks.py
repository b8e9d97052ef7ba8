"""What the XLA engine (device=tpu|xla) does not run, refused before any work with one line naming the key. Imports no
jax and no torch: ember/xla/rules.py, the engine's rules, calls it with the config."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ember.config import fp8_enabled
from ember.config_schema import JobConfig
from ember.errors import ConfigError
from ember.parallel.mesh_shape import MeshShape

if TYPE_CHECKING:  # an annotation only: importing it here would load torch with the config's checks
    from ember.nn.args import DecoderArgs

PIPELINE_REFUSED = ("{where} has no pipeline parallelism (XLA shards layers with fsdp/tensor instead); set "
                    "ici_mesh.pipeline=1 and dcn_mesh.pipeline=1")


def refuse_pipeline(cfg: JobConfig) -> None:
    """Callers run it before resolving the mesh too: a pipeline degree changes the device count a mesh error would
    name (-1, fill the rest with pipeline stages, is refused as well)."""
    if cfg.ici_mesh.pipeline != 1 or cfg.dcn_mesh.pipeline != 1:
        raise ConfigError(PIPELINE_REFUSED.format(where=f"device={cfg.device}"))


def refuse_offload_without_host_memory(cfg: JobConfig, platform: str) -> None:
    """remat=offload moves saved activations to the host's pinned memory, which XLA does on TPUs and GPUs; its CPU
    compiler keeps them where they are, so on jax's cpu devices the policy would silently save nothing."""
    if cfg.model.remat == "offload" and platform not in ("tpu", "gpu"):
        raise ConfigError(f"model.remat=offload needs a TPU's or GPU's pinned host memory, and jax's devices are "
                          f"{platform}; use model.remat=full")


def mesh_error(message: str, device: str, devices: int) -> str:
    """The torch path's mesh error worded for jax's devices (and how to get N of them on a CPU)."""
    more = ("; on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N JAX_PLATFORMS=cpu makes N devices"
            if device == "xla" else "")
    return message.replace("the number of processes", f"jax's {devices} device(s)") + more


def check(cfg: JobConfig, shape: MeshShape) -> None:
    where = f"device={cfg.device}"
    refuse_pipeline(cfg)
    refused = [
        (cfg.task != "lm", f"task={cfg.task}", "task=lm, or train DPO and GRPO on cpu/cuda (GRPO's rollouts need "
         "KV-cache generation, which the XLA engine does not have yet)"),
        (cfg.lora.rank > 0, "lora.rank", "lora.rank=0, or fine-tune with LoRA on cpu/cuda"),
        (fp8_enabled(cfg), "precision=fp8 (fp8.enabled)", "precision=bf16"),
        # torch.compile compiles torch's own kernels; this path traces the whole step into one jax.jit already
        (cfg.compile, "compile=true", "compile=false (the whole step is compiled by XLA already)"),
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



def check_score_bias(cfg: JobConfig, args: Any) -> None:
    """The compiled step holds the model's buffers as constants, so a router's score bias (DeepSeek-V3) would never
    move: refused while model.bias_update_rate asks it to."""
    if getattr(args, "score_bias", False) and getattr(args, "n_experts", 0) and cfg.model.bias_update_rate > 0:
        raise ConfigError(f"device={cfg.device} does not update the routers' score biases (aux-loss-free balancing) "
                          f"yet; set model.bias_update_rate=0 to train with them frozen, or use device=cpu/cuda")


def check_scan(cfg: JobConfig, args: DecoderArgs) -> None:
    """model.scan_layers against the model (model.init_from's architecture, read): one scanned block stands for
    every block, so they must be the same computation: one attention span, one RoPE table, experts everywhere or
    nowhere."""
    if not cfg.model.scan_layers:
        return
    spans = {args.layer_span(i) for i in range(args.n_layers)}
    experts = {args.is_moe_layer(i) for i in range(args.n_layers)}
    ropes = {args.uses_rope(i) for i in range(args.n_layers)}
    differences = [what for differ, what in (
        (len(spans) > 1, " and ".join(sorted({_span_words(span) for span in spans}))),
        (len(ropes) > 1, "RoPE and NoPE layers"),
        (args.local_rope is not None and len(spans) > 1, "local layers with their own RoPE base"),
        (len(experts) > 1, "dense and MoE layers"),
    ) if differ]
    if differences:
        raise ConfigError(f"model.scan_layers=true needs every block alike, and this {cfg.model.family} model's blocks "
                          f"differ ({'; '.join(differences)}); drop model.scan_layers")


def _span_words(span: Any) -> str:
    if span is None:
        return "full-attention layers"
    if getattr(span, "chunk", None):
        return f"chunked-attention layers ({span.chunk}-token chunks)"
    return f"sliding-window layers ({span.window}-token window)"
