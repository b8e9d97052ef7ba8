"""The device and compute dtype a run uses: the `device` key's device (this process's GPU under torchrun) and
what `precision` means on it (on a CPU, measured: ember/hardware/cpu_rates.py), and whether this CPU has bf16
matmuls."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ember.errors import ConfigError
from ember.hardware import cpu_rates


def pick_device(name: str) -> torch.device:
    """The `device` key's device; on CUDA, this process's GPU (LOCAL_RANK, as torchrun sets it)."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is visible; use device=cpu or device=auto")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device(name)


# precision=auto trains in bf16 on a CPU only where its bf16 matmuls ran at least this much faster than fp32's at
# the model's shapes: bf16 autocast adds casts and rounds the activations, which a few percent would not repay.
BF16_MIN_SPEEDUP = 1.2


@dataclass(frozen=True)
class PrecisionChoice:
    """The compute dtype `precision` means on a device, and why, where precision=auto chose on a CPU (None
    elsewhere: on a GPU auto is bf16 as everyone expects; an explicit precision is the user's)."""

    dtype: torch.dtype
    reason: Optional[str] = None

    def training_note(self) -> Optional[str]:
        """The training header's line on the choice (autocast keeps fp32 weights and optimizer state)."""
        if self.reason is None:
            return None
        if self.dtype == torch.bfloat16:
            return (f"precision: auto -> bf16 autocast ({self.reason}; fp32 weights, gradients and optimizer state); "
                    "precision=fp32 opts out")
        return f"precision: auto -> fp32 ({self.reason})"


def choose_compute_dtype(precision: str, device: torch.device, gemms: Callable[[], list[cpu_rates.Gemm]],
                         training: bool = True) -> PrecisionChoice:
    """The compute dtype `precision` means on `device`. auto: bf16 on CUDA with bf16 support; on a CPU, bf16
    where its bf16 matmuls measured at least BF16_MIN_SPEEDUP x fp32's at `gemms()`, the model's own matmuls (a
    training step's or, not `training`, the forward's; `cpu_rates.cpu_gemm_rates`, once per machine), fp32
    elsewhere. A CPU without bf16 matmul instructions (AVX512-BF16, AMX, ARM's BF16) is not measured: torch
    emulates bf16 there, far slower. EMBER_CPU_BF16 declares the answer instead of measuring. Training's autocast
    keeps the parameters, gradients and AdamW's state in fp32; the default run's losses under it stay within 1%
    of fp32's (benchmarks/bf16_parity.py). fp8 computes in bf16 outside the float8 matmuls of its linears
    (ember/parallel/fp8.py)."""
    precision = "bf16" if precision == "fp8" else precision
    if precision == "fp32":
        return PrecisionChoice(torch.float32)
    if precision == "bf16":
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ConfigError("precision=bf16 but this GPU has no bf16 support; use precision=fp32")
        return PrecisionChoice(torch.bfloat16)
    if device.type == "cuda":
        return PrecisionChoice(torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32)
    if device.type != "cpu":
        return PrecisionChoice(torch.float32)
    declared = cpu_bf16_declared()
    if declared is not None:
        return (PrecisionChoice(torch.bfloat16, "EMBER_CPU_BF16=1 declares bf16 matmul instructions, not measured")
                if declared else
                PrecisionChoice(torch.float32, "EMBER_CPU_BF16=0 declares no bf16 matmul instructions, not measured"))
    if not cpu_runs_bf16_natively():
        cap = onednn_cap_without_bf16()
        return PrecisionChoice(torch.float32, f"ONEDNN_MAX_CPU_ISA={cap} holds oneDNN below bf16 matmul instructions"
                               if cap else "this CPU has no bf16 matmul instructions: AVX512-BF16, AMX")
    measured = cpu_rates.cpu_gemm_rates(gemms(), training)
    fp32, bf16 = measured.rates["fp32"], measured.rates["bf16"]
    why = (f"bf16 matmuls ran {bf16 / fp32:.2f}x fp32's at this model's shapes on this CPU: {_rate(bf16)} vs "
           f"{_rate(fp32)}, {measured.where}")
    if bf16 >= BF16_MIN_SPEEDUP * fp32:
        return PrecisionChoice(torch.bfloat16, why)
    return PrecisionChoice(torch.float32, f"{why}; auto takes bf16 from {BF16_MIN_SPEEDUP}x, precision=bf16 forces it")


def _rate(flops: float) -> str:
    """FLOP/s as the header says it: TFLOP/s, or GFLOP/s for a decode step's small products."""
    return f"{flops / 1e12:.3f} TFLOP/s" if flops >= 1e11 else f"{flops / 1e9:.3g} GFLOP/s"


def pick_compute_dtype(precision: str, device: torch.device,
                       gemms: Optional[Callable[[], list[cpu_rates.Gemm]]] = None) -> torch.dtype:
    """`choose_compute_dtype`'s dtype. `gemms` may be left out only where precision=auto cannot reach a CPU
    measurement (an explicit precision, an accelerator, EMBER_CPU_BF16 set): a CPU's choice needs the model's
    shapes, and asking without them is a programming error."""
    def no_shapes() -> list[cpu_rates.Gemm]:
        raise ValueError("precision=auto on a CPU with bf16 instructions measures the model's GEMMs: pass gemms")

    return choose_compute_dtype(precision, device, gemms or no_shapes).dtype


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


# oneDNN's ISA caps (ONEDNN_MAX_CPU_ISA) below AVX512_CORE_BF16: no bf16 dot-product instructions
ONEDNN_ISAS_WITHOUT_BF16 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                                      "AVX512_CORE_VNNI"})


def onednn_cap_without_bf16() -> Optional[str]:
    """The ONEDNN_MAX_CPU_ISA setting that holds oneDNN below bf16 instructions this CPU may have, or None."""
    isa = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    return isa if isa in ONEDNN_ISAS_WITHOUT_BF16 else None


def cpu_runs_bf16_natively() -> bool:
    """Whether this CPU has bf16 matmul instructions (x86 AVX512-BF16 or AMX-BF16; ARM's BF16 extension), which
    oneDNN's bf16 kernels need: without them torch emulates bf16, many times slower than fp32. Having them does
    not make bf16 faster (an AVX512-BF16 Xeon without AMX runs bf16 matmuls at 0.5-0.7x fp32): precision=auto
    measures (`choose_compute_dtype`). EMBER_CPU_BF16 overrides what torch detects (`cpu_bf16_declared`)."""
    declared = cpu_bf16_declared()
    if declared is not None:
        return declared
    if onednn_cap_without_bf16() is not None:
        return False
    capabilities = getattr(torch.cpu, "get_capabilities", None)  # torch >= 2.7
    if capabilities is None:
        return False
    try:
        found = capabilities()
    except (RuntimeError, OSError):
        return False
    return any(bool(found.get(flag)) for flag in ("avx512_bf16", "amx_bf16", "bf16"))
