"""What benchmarks/maxtext_peer.py runs on each side: the Llama shapes and layouts, ember's and MaxText's command
lines for them (the same model, batch, optimizer and layout in each trainer's keys), the devices' environment, and
the step times each side's output says."""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional


@dataclass(frozen=True)
class Shape:
    """A Llama 3 shape, as both trainers spell it (ember's model.* keys, MaxText's base_* keys)."""
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden_dim: int
    vocab_size: int
    batch: int  # global, sequences
    seq_len: int
    steps: int  # a run's length, warm-up included


# debug: ember's `debug` recipe's model; 100m: a GPT-2-small-sized Llama (125M parameters, 49M of them embeddings)
SHAPES = {"debug": Shape(256, 4, 8, 4, 704, 8192, batch=8, seq_len=256, steps=20),
          "100m": Shape(768, 12, 12, 4, 2048, 32000, batch=8, seq_len=256, steps=6)}
# name -> (jax devices, fsdp, tensor)
LAYOUTS = {"1": (1, 1, 1), "fsdp8": (8, 8, 1), "fsdp4-tensor2": (8, 4, 2)}
PRECISIONS = {"fp32": "float32", "bf16": "bfloat16"}  # ember's precision -> MaxText's dtype (weights stay fp32)
ROPE_THETA = 500000.0  # Llama 3's, ember's debug flavor's
MAXTEXT_STEP = re.compile(r"completed step: (\d+), seconds: ([0-9.]+).*?loss: ([0-9.]+)")


def device_env(devices: int, dump_hlo: Optional[Path] = None) -> dict[str, str]:
    """jax's CPU backend with `devices` virtual devices (and XLA's HLO dumps where asked), the rest of os.environ."""
    flags = [f"--xla_force_host_platform_device_count={devices}"]
    if dump_hlo is not None:
        flags += [f"--xla_dump_to={dump_hlo}", "--xla_dump_hlo_as_text"]
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags), TOKENIZERS_PARALLELISM="false")


def ember_command(shape: Shape, layout: str, precision: str, logging_steps: int, output_dir: Path,
                  python: str = sys.executable) -> list[str]:
    devices, fsdp, tensor = LAYOUTS[layout]
    return [python, "-m", "ember", "train", "debug", "device=xla", f"precision={precision}",
            f"model.dim={shape.dim}", f"model.n_layers={shape.n_layers}", f"model.n_heads={shape.n_heads}",
            f"model.n_kv_heads={shape.n_kv_heads}", f"model.ffn_hidden_dim={shape.ffn_hidden_dim}",
            f"model.vocab_size={shape.vocab_size}", "model.scan_layers=true", "model.remat=full",
            f"global_batch_size={shape.batch}", f"micro_batch_size={shape.batch * tensor // devices}",
            f"seq_len={shape.seq_len}", f"ici_mesh.fsdp={fsdp}", f"ici_mesh.tensor={tensor}",
            "optim.betas=[0.9,0.95]", "optim.eps=1e-8", "optim.weight_decay=0.1", "optim.max_grad_norm=1.0",
            f"max_steps={shape.steps}", f"logging_steps={logging_steps}", "data.dataset=synthetic",
            "checkpoint.interval=0", "eval_interval=0", "resume=none", "seed=0", "metrics.console=false",
            f"output_dir={output_dir}"]


def maxtext_command(python: Path, shape: Shape, layout: str, precision: str, output_dir: Path) -> list[str]:
    """MaxText's pre-training entry point with its base.yml and the same model, batch, optimizer and layout."""
    devices, fsdp, tensor = LAYOUTS[layout]
    return [str(python), "-m", "maxtext.trainers.pre_train.train", "BASE_YML", "run_name=peer",
            f"base_output_directory={output_dir}", "hardware=cpu", "skip_jax_distributed_system=true",
            "dataset_type=synthetic", f"steps={shape.steps}", "enable_checkpointing=false",
            f"per_device_batch_size={shape.batch / devices:g}", f"max_target_length={shape.seq_len}",
            f"dtype={PRECISIONS[precision]}", "weight_dtype=float32", f"base_emb_dim={shape.dim}",
            f"base_num_query_heads={shape.n_heads}", f"base_num_kv_heads={shape.n_kv_heads}",
            f"base_mlp_dim={shape.ffn_hidden_dim}", f"base_num_decoder_layers={shape.n_layers}",
            f"head_dim={shape.dim // shape.n_heads}", f"vocab_size={shape.vocab_size}", "decoder_block=llama2",
            "logits_via_embedding=false", "normalization_layer_epsilon=1e-5", f"rope_max_timescale={ROPE_THETA:g}",
            "scan_layers=true", "remat_policy=full", "attention=dot_product", "enable_dropout=false",
            "opt_type=adamw", "adam_b1=0.9", "adam_b2=0.95", "adam_eps=1e-8", "adam_weight_decay=0.1",
            "gradient_clipping_threshold=1.0", "enable_tensorboard=false", "enable_goodput_recording=false",
            f"ici_fsdp_parallelism={fsdp}", f"ici_tensor_parallelism={tensor}", "ici_data_parallelism=1"]


def maxtext_steps(log: str) -> list[tuple[int, float, float]]:
    """(step, seconds, loss) of each `completed step` line MaxText logged."""
    return [(int(m[1]), float(m[2]), float(m[3])) for m in MAXTEXT_STEP.finditer(log)]


def ember_steps(metrics: list[dict[str, Any]], tokens_per_step: int) -> list[tuple[int, float, float]]:
    """(last step of the window, seconds a step, loss) of each window in ember's metrics.jsonl records."""
    return [(r["step"], tokens_per_step / r["tokens_per_s"], r["loss"]) for r in metrics if "tokens_per_s" in r]
