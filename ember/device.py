"""The device and compute dtype a run uses: the `device` key's device (this process's GPU under torchrun) and
what `precision` means on it, and whether this CPU runs bf16 matmuls natively."""

from __future__ import annotations

import os

import torch

from ember.errors import ConfigError


def pick_device(name: str) -> torch.device:
    """The `device` key's device; on CUDA, this process's GPU (LOCAL_RANK, as torchrun sets it)."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is visible; use device=cpu or device=auto")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device(name)


def pick_compute_dtype(precision: str, device: torch.device, frozen_base: bool = False) -> torch.dtype:
    """The compute dtype `precision` means on `device`. auto: bf16 autocast where the device runs it fast (CUDA
    with bf16 support); on CPU fp32, except for a frozen base (LoRA) on a CPU with native bf16 matmuls (see
    `cpu_runs_bf16_natively`). Full training on CPU keeps fp32 by default: CPU runs are the debugging and
    reference runs, whose losses the multi-process layouts must match exactly; a frozen base takes no updates,
    so storing and multiplying it in bf16 costs no precision that training keeps (the adapters, their
    gradients and AdamW's state stay fp32). fp8 computes in bf16 outside the float8 matmuls of its linears
    (ember/parallel/fp8.py)."""
    precision = "bf16" if precision == "fp8" else precision
    if precision == "fp32":
        return torch.float32
    if precision == "bf16":
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ConfigError("precision=bf16 but this GPU has no bf16 support; use precision=fp32")
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if frozen_base and device.type == "cpu" and cpu_runs_bf16_natively() else torch.float32


def cpu_runs_bf16_natively() -> bool:
    """Whether this CPU has bf16 matmul instructions (x86 AVX512-BF16 or AMX-BF16; ARM's BF16 extension),
    which oneDNN uses for bf16 matmuls several times faster than fp32. Without them torch emulates bf16,
    slower than fp32."""
    capabilities = getattr(torch.cpu, "get_capabilities", None)  # torch >= 2.7
    if capabilities is None:
        return False
    try:
        found = capabilities()
    except (RuntimeError, OSError):
        return False
    return any(bool(found.get(flag)) for flag in ("avx512_bf16", "amx_bf16", "bf16"))
