"""The device and compute dtype a run uses: the `device` key's device (this process's GPU under torchrun) and
what `precision` means on it, and whether this CPU runs bf16 matmuls natively."""

from __future__ import annotations

import os
from typing import Optional

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


def pick_compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The compute dtype `precision` means on `device`. auto: bf16 autocast where the device runs bf16 matmuls
    natively (CUDA with bf16 support; a CPU with AVX512-BF16, AMX or ARM's BF16, see `cpu_runs_bf16_natively`),
    fp32 elsewhere: without those instructions torch emulates bf16 on a CPU, far slower than fp32. Autocast keeps
    the parameters, gradients and AdamW's state in fp32; the default run's losses under it stay within 1% of
    fp32's (benchmarks/bf16_parity.py, tests/train/test_precision_auto.py). precision=fp32 opts out. fp8 computes
    in bf16 outside the float8 matmuls of its linears (ember/parallel/fp8.py)."""
    precision = "bf16" if precision == "fp8" else precision
    if precision == "fp32":
        return torch.float32
    if precision == "bf16":
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ConfigError("precision=bf16 but this GPU has no bf16 support; use precision=fp32")
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if device.type == "cpu" and cpu_runs_bf16_natively() else torch.float32


def precision_note(precision: str, device: torch.device, compute_dtype: torch.dtype) -> Optional[str]:
    """The header's line on what precision=auto chose on a CPU, and why (None elsewhere: on a GPU auto is bf16
    as everyone expects, and an explicit precision is what the user chose)."""
    if precision != "auto" or device.type != "cpu":
        return None
    declared = cpu_bf16_declared()
    if compute_dtype == torch.bfloat16:
        why = ("EMBER_CPU_BF16=1 declares bf16 matmul instructions, not detected" if declared else
               "this CPU has bf16 matmul instructions, several times fp32's rate")
        return f"precision: auto -> bf16 autocast ({why}; fp32 weights, gradients and optimizer state); precision=fp32 opts out"
    why = ("EMBER_CPU_BF16=0 declares no bf16 matmul instructions, not detected" if declared is False else
           "this CPU has no bf16 matmul instructions: AVX512-BF16, AMX")
    return f"precision: auto -> fp32 ({why})"


def cpu_bf16_declared() -> Optional[bool]:
    """EMBER_CPU_BF16's answer (1: this CPU has bf16 matmul instructions, 0: it has none), None where unset: a VM
    that hides or misreports its CPU's flags, a test suite that must decide the same on every machine."""
    forced = os.environ.get("EMBER_CPU_BF16", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    if forced:
        raise ConfigError(f"EMBER_CPU_BF16={forced!r}: use 1 (this CPU has bf16 matmul instructions), 0 (it has "
                          "none) or leave it unset to detect")
    return None


def cpu_runs_bf16_natively() -> bool:
    """Whether this CPU has bf16 matmul instructions (x86 AVX512-BF16 or AMX-BF16; ARM's BF16 extension),
    which oneDNN uses for bf16 matmuls several times faster than fp32. Without them torch emulates bf16,
    slower than fp32. EMBER_CPU_BF16 overrides what torch detects (`cpu_bf16_declared`)."""
    declared = cpu_bf16_declared()
    if declared is not None:
        return declared
    capabilities = getattr(torch.cpu, "get_capabilities", None)  # torch >= 2.7
    if capabilities is None:
        return False
    try:
        found = capabilities()
    except (RuntimeError, OSError):
        return False
    return any(bool(found.get(flag)) for flag in ("avx512_bf16", "amx_bf16", "bf16"))
