"""Peak FLOP/s and memory per device, for MFU: a table for accelerators, a measurement for the CPU.

Every number is the vendor's PEAK DENSE rate per device as torch sees it. NVIDIA datasheets print the
tensor-core rates "with sparsity" (2:4 structured sparsity, which training does not use): the dense rate
is half of the printed one, and that half is what the table holds. A device missing from the table has no
peak (never a guess): the caller says so once and MFU is null until the user sets `metrics.peak_tflops`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from ember.hardware import cpu_rates
from ember.hardware.device import cpu_runs_bf16_natively


@dataclass(frozen=True)
class DeviceSpec:
    """Dense peak FLOP/s per precision (None: the device has no such rate) and HBM per device as printed
    (vendors' "GB" are GiB in practice, the unit `ember.metrics.run_metrics.peak_memory_gb` reports)."""

    name: str
    bf16: Optional[float]  # also the fp16 rate: equal on every device below
    fp8: Optional[float]
    fp32: Optional[float]  # plain fp32 (CUDA cores / vector units), what fp32 matmuls get without TF32
    tf32: Optional[float]  # fp32 matmuls with TF32 allowed (NVIDIA) / XF32 (AMD CDNA3)
    memory_gb: float
    source: str  # the datasheet or whitepaper the numbers come from


# --- NVIDIA: dense = the datasheet's "with sparsity" tensor-core figure / 2 (marked * below, as the
# datasheets mark them); FP32 on the CUDA cores has no sparse figure.
# "NVIDIA A100 Tensor Core GPU" datasheet: BF16 312 (624*), TF32 156 (312*), FP32 19.5; no FP8.
# The PCIe cards print the same peaks (at a lower power limit), so they share the SXM entries.
A100_40GB = DeviceSpec("NVIDIA A100 40GB", 312e12, None, 19.5e12, 156e12, 40, "NVIDIA A100 datasheet")
A100_80GB = DeviceSpec("NVIDIA A100 80GB", 312e12, None, 19.5e12, 156e12, 80, "NVIDIA A100 datasheet")
# "NVIDIA H100 Tensor Core GPU" datasheet, H100 SXM: BF16 1,979*, FP8 3,958*, TF32 989*, FP32 67.
# The unrounded dense figures 989.4 / 1978.9 / 494.7 and FP32 66.9 are those of the "NVIDIA H100 Tensor
# Core GPU Architecture" whitepaper's comparison table.
H100_SXM = DeviceSpec("NVIDIA H100 SXM", 989.4e12, 1978.9e12, 66.9e12, 494.7e12, 80, "NVIDIA H100 datasheet")
# Same datasheet, H100 PCIe: BF16 1,513*, FP8 3,026*, TF32 756*, FP32 51 (51.2 in the whitepaper); 80 GB.
H100_PCIE = DeviceSpec("NVIDIA H100 PCIe", 756.5e12, 1513e12, 51.2e12, 378e12, 80, "NVIDIA H100 datasheet")
# Same datasheet, H100 NVL (per GPU): BF16 1,671*, FP8 3,341*, TF32 835*, FP32 60; 94 GB HBM3.
H100_NVL = DeviceSpec("NVIDIA H100 NVL", 835.5e12, 1670.5e12, 60e12, 417.5e12, 94, "NVIDIA H100 datasheet")
# "NVIDIA H200 Tensor Core GPU" datasheet: H200 SXM has the H100 SXM's compute with 141 GB of HBM3e;
# H200 NVL has the H100 NVL's compute (BF16 1,671*, FP8 3,341*) with 141 GB.
H200_SXM = DeviceSpec("NVIDIA H200 SXM", 989.4e12, 1978.9e12, 66.9e12, 494.7e12, 141, "NVIDIA H200 datasheet")
H200_NVL = DeviceSpec("NVIDIA H200 NVL", 835.5e12, 1670.5e12, 60e12, 417.5e12, 141, "NVIDIA H200 datasheet")
# "NVIDIA GH200 Grace Hopper Superchip" datasheet: the GPU is an H100 SXM (FP8 3,958*); 96 GB HBM3
# (a 144 GB HBM3e variant exists; memory_gb is informational only).
GH200 = DeviceSpec("NVIDIA GH200", 989.4e12, 1978.9e12, 66.9e12, 494.7e12, 96, "NVIDIA GH200 datasheet")
# "NVIDIA HGX B200" / "DGX B200" datasheets, 8 GPUs: FP16/BF16 36 PF*, FP8 72 PF*, TF32 18 PF*,
# FP32 600 TF, 1,440 GB -> per GPU BF16 2.25 PF, FP8 4.5 PF, TF32 1.125 PF dense, FP32 75 TF, 180 GB.
# (The B200 inside a GB200 runs at a higher power limit and reaches 2.5 PF: see GB200 below.)
B200 = DeviceSpec("NVIDIA B200", 2250e12, 4500e12, 75e12, 1125e12, 180, "NVIDIA HGX/DGX B200 datasheet")
# "NVIDIA GB200 NVL72" datasheet, 72 GPUs: FP16/BF16 360 PF*, FP8 720 PF*, TF32 180 PF*, FP32 6,480 TF,
# HBM3e 13.4 TB -> per GPU BF16 2.5 PF, FP8 5 PF, TF32 1.25 PF dense, FP32 90 TF, 186 GB.
GB200 = DeviceSpec("NVIDIA GB200", 2500e12, 5000e12, 90e12, 1250e12, 186, "NVIDIA GB200 NVL72 datasheet")

# --- AMD: the Instinct datasheets print dense peaks (sparsity separately), so no halving.
# "AMD Instinct MI250X" datasheet: FP16/BF16 383 TF, FP32 matrix 95.7 TF, 128 GB HBM2e, no FP8/TF32.
# An MI250X is two GCDs and torch sees each GCD as its own device, so one torch device gets half.
MI250X = DeviceSpec("AMD Instinct MI250X (one GCD)", 191.5e12, None, 47.85e12, None, 64, "AMD MI250X datasheet")
# "AMD Instinct MI300X" datasheet: BF16 1,307.4, FP8 2,614.9, TF32 653.7, FP32 163.4 TF; 192 GB HBM3.
MI300X = DeviceSpec("AMD Instinct MI300X", 1307.4e12, 2614.9e12, 163.4e12, 653.7e12, 192, "AMD MI300X datasheet")
# "AMD Instinct MI325X" datasheet: the MI300X's compute with 256 GB of HBM3E.
MI325X = DeviceSpec("AMD Instinct MI325X", 1307.4e12, 2614.9e12, 163.4e12, 653.7e12, 256, "AMD MI325X datasheet")
# "AMD Instinct MI350X / MI355X" datasheets and the CDNA 4 whitepaper: MI355X FP16/BF16 2.5 PF, FP8 5 PF,
# FP32 157.3 TF; MI350X 2.3 PF / 4.6 PF / 144.2 TF; 288 GB HBM3E each. Unrounded: 256 CUs x 4,096 dense
# BF16 FLOP/clk x 2.4 GHz (MI355X) or 2.2 GHz (MI350X). No TF32/XF32 rate is listed for CDNA 4.
MI350X = DeviceSpec("AMD Instinct MI350X", 2306.9e12, 4613.7e12, 144.2e12, None, 288, "AMD MI350X datasheet")
MI355X = DeviceSpec("AMD Instinct MI355X", 2516.6e12, 5033.2e12, 157.3e12, None, 288, "AMD MI355X datasheet")

# --- Google TPU, per chip: the Cloud TPU system-architecture pages (tpu/docs/v4, v5e, v5p, v6e, tpu7x), no fp32/TF32
# rate; int8 in `source`. FP8: the TPU7x page's table gives TPU7x 4,614; v5p 459 and v6e 918 (no faster than bf16).
TPU_V4 = DeviceSpec("TPU v4", 275e12, None, None, None, 32, "Cloud TPU v4 docs: 275 TFLOPs bf16 or int8, 32 GiB")
TPU_V5E = DeviceSpec("TPU v5e", 197e12, None, None, None, 16, "Cloud TPU v5e docs: int8 393 TOPs")
TPU_V5P = DeviceSpec("TPU v5p", 459e12, None, None, None, 95, "Cloud TPU v5p docs; int8 918 TOPs: v5p launch post")
TPU_V6E = DeviceSpec("TPU v6e", 918e12, None, None, None, 32, "Cloud TPU v6e docs: int8 1,836 TOPs")
TPU_7X = DeviceSpec("TPU7x (Ironwood)", 2307e12, 4614e12, None, None, 192, "Cloud TPU7x docs: no int8 figure")
TPUS = (TPU_V4, TPU_V5E, TPU_V5P, TPU_V6E, TPU_7X)

# Matched in order against the upper-cased device name; the first hit wins. Order matters where one
# name contains another: GH200 and GB200 before H200/B200, NVL and PCIe before the plain H100.
# Name strings are what torch.cuda.get_device_name() returns (ROCm builds too) and the TPU device kinds.
_NAME_PATTERNS: list[tuple[str, DeviceSpec]] = [
    (r"GH200", GH200),
    (r"GB200", GB200),
    (r"H200.*NVL", H200_NVL),
    (r"H200", H200_SXM),  # "NVIDIA H200"
    (r"H100.*NVL", H100_NVL),  # "NVIDIA H100 NVL"
    (r"H100.*PCIE", H100_PCIE),  # "NVIDIA H100 PCIe"
    (r"H100", H100_SXM),  # "NVIDIA H100 80GB HBM3"
    (r"B200", B200),  # "NVIDIA B200"
    (r"A100.*40GB", A100_40GB),  # "NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"
    (r"A100", A100_80GB),  # "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"
    (r"MI250X", MI250X),  # "AMD Instinct MI250X"
    (r"MI300X", MI300X),  # "AMD Instinct MI300X", "AMD Instinct MI300X VF"
    (r"MI325X", MI325X),
    (r"MI350X", MI350X),
    (r"MI355X", MI355X),
    (r"V5E|V5 ?LITE", TPU_V5E),  # JAX/XLA device kind "TPU v5 lite"
    (r"V6E|V6 ?LITE|TRILLIUM", TPU_V6E),  # "TPU v6 lite"
    (r"V5P|TPU V5\b", TPU_V5P),  # "TPU v5"
    (r"(^|TPU[ _-]?)V4\b(?! ?LITE)", TPU_V4),  # "TPU v4", not "TPU v4 lite" (v4i, never a Cloud TPU)
    (r"TPU[ _-]?V?7X?\b|^V?7X\b|IRONWOOD", TPU_7X),  # "TPU7x"
]


def match_device(name: str) -> Optional[DeviceSpec]:
    """The table entry for a device name such as torch.cuda.get_device_name() returns, or None."""
    upper = name.upper()
    for pattern, spec in _NAME_PATTERNS:
        if re.search(pattern, upper):
            return spec
    return None


@dataclass(frozen=True)
class PeakFlops:
    value_flops: Optional[float]  # None: unknown, MFU is not reported
    source: str  # where the number comes from, or why there is none
    measured: bool = False  # a CPU measurement: raised if a run ever goes faster (see raise_measured_peak)
    cpu_dtype: torch.dtype = torch.float32  # a CPU measurement: the dtype its matmuls ran in (its cache entry)
    provisional: bool = False  # a CPU measurement made while other processes were busy (measured again if beaten)
    run_rate: bool = False  # raised to this process's own training rate: MFU against it reads 1 by construction

    def describe(self) -> dict[str, Any]:
        """run.json's `mfu_peak`: what MFU divides by, and whether that figure can be trusted yet."""
        return {"tflops": None if self.value_flops is None else self.value_flops / 1e12, "source": self.source,
                "dtype": cpu_rates.dtype_name(self.cpu_dtype) if self.measured else None,
                "provisional": self.provisional or self.run_rate}


def peak_flops(device: torch.device, dtype: torch.dtype, user_peak_tflops: Optional[float] = None) -> PeakFlops:
    """Peak dense FLOP/s of one device for matmuls in `dtype`; `metrics.peak_tflops` overrides all."""
    if device.type == "cpu" and user_peak_tflops is None:
        # bf16 is measured only where the CPU has bf16 instructions: elsewhere a bf16 matmul runs at ~1 GFLOP/s
        # (emulated) and would not fit the time budget, so MFU is against fp32; the label says which rate.
        cpu_dtype = torch.bfloat16 if dtype == torch.bfloat16 and cpu_runs_bf16_natively() else torch.float32
        return _cpu_peak(cpu_dtype, cpu_rates.cpu_peak_flops(cpu_dtype))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return _datasheet_peak(match_device(name), name, dtype, user_peak_tflops)


def _cpu_peak(dtype: torch.dtype, measured: cpu_rates.Rates) -> PeakFlops:
    name, threads = cpu_rates.dtype_name(dtype), torch.get_num_threads()
    return PeakFlops(measured.rates[name],
                     f"measured CPU {name} matmul, {threads} thread{'s' if threads != 1 else ''}, "
                     f"{measured.where}", measured=True, cpu_dtype=dtype, provisional=not measured.quiet)


def tpu_spec(device_kind: str) -> Optional[DeviceSpec]:
    """A TPU chip's entry by jax's `device.device_kind` ("TPU v6 lite", "TPU7x") or a user's name ("tpu-v6e", "v5p")."""
    return spec if (spec := match_device(device_kind.strip())) in TPUS else None


def tpu_peak_flops(device_kind: str, dtype: torch.dtype, user_peak_tflops: Optional[float] = None) -> PeakFlops:
    """peak_flops for one TPU chip named by jax's `device.device_kind`; `metrics.peak_tflops` overrides it."""
    return _datasheet_peak(tpu_spec(device_kind), device_kind, dtype, user_peak_tflops)


def named_peak_flops(name: str, dtype: torch.dtype, user_peak_tflops: Optional[float] = None) -> PeakFlops:
    """peak_flops for an accelerator known only by name (jax's GPU `device_kind`, "NVIDIA H200")."""
    return _datasheet_peak(match_device(name), name, dtype, user_peak_tflops)


def _datasheet_peak(spec: Optional[DeviceSpec], name: str, dtype: torch.dtype, user: Optional[float]) -> PeakFlops:
    if user is not None:
        return PeakFlops(user * 1e12, "metrics.peak_tflops")
    if spec is None:
        return PeakFlops(None, f"unknown device '{name}': set metrics.peak_tflops")
    precision = _precision(dtype)
    if precision == "tf32" and spec.tf32 is None:
        precision = "fp32"  # TF32 allowed, but the device has none: its fp32 matmuls run in full fp32
    value = getattr(spec, precision)
    if value is None:
        return PeakFlops(None, f"{spec.name} has no {precision} peak in ember.hardware.peaks: set metrics.peak_tflops")
    return PeakFlops(value, f"{spec.name} {precision} dense ({spec.source})")


def _precision(dtype: torch.dtype) -> str:
    """The table column for matmuls in `dtype`."""
    if dtype in (torch.bfloat16, torch.float16):
        return "bf16"
    if dtype.is_floating_point and dtype.itemsize == 1:  # float8_e4m3fn, float8_e5m2, ...
        return "fp8"
    return "tf32" if _tf32_allowed() else "fp32"


def _tf32_allowed() -> bool:
    # torch >= 2.9 has per-backend `fp32_precision` ("none" = inherit the global setting); reading the
    # legacy `allow_tf32` raises once the new API has been used, so read the new one where it exists.
    matmul = torch.backends.cuda.matmul
    try:
        precision = matmul.fp32_precision
    except AttributeError:
        return bool(matmul.allow_tf32)
    if precision == "none":
        precision = getattr(torch.backends, "fp32_precision", "none")
    return precision == "tf32"


def raise_measured_peak(peak: PeakFlops, achieved_flops: float) -> PeakFlops:
    """A measured CPU peak that a run beat was measured too low (a model's FLOPs are matmul FLOPs: it cannot
    outrun the matmul rate). A provisional one (measured while other processes were busy) is measured again now;
    where the run still beats the peak, the run's rate becomes the peak, in the cache too, and the PeakFlops says
    so (`run_rate`: MFU against it is 1 by construction, and the console marks it). Other peaks (datasheets,
    metrics.peak_tflops) are returned as they are."""
    if not peak.measured or peak.value_flops is None or achieved_flops <= peak.value_flops:
        return peak
    if peak.provisional:
        again = cpu_rates.cpu_peak_flops(peak.cpu_dtype, again=True)
        remeasured = _cpu_peak(peak.cpu_dtype, again)
        if achieved_flops <= remeasured.value_flops:
            return remeasured
        peak = remeasured
    flops = cpu_rates.raise_cached_peak(peak.cpu_dtype, achieved_flops)
    raised = "matmul, raised to a training run's rate"
    return replace(peak, value_flops=flops, run_rate=True,
                   source=peak.source if raised in peak.source else peak.source.replace("matmul", raised, 1))
