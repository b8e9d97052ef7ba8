"""The Cloud TPU rows of the peak table: jax's device kinds and users' names to a chip, the peak per dtype, the
unknown-chip and metrics.peak_tflops paths (ember.hardware.peaks.tpu_spec, tpu_peak_flops)."""

import pytest
import torch

from ember.hardware import peaks as hardware
from ember.hardware.peaks import PeakFlops, named_peak_flops, tpu_peak_flops, tpu_spec

# (entry, bf16 TFLOP/s, fp8 TFLOP/s or None, HBM GiB): the Cloud TPU system-architecture pages' figures.
TABLE = [
    (hardware.TPU_V4, 275, None, 32),
    (hardware.TPU_V5E, 197, None, 16),
    (hardware.TPU_V5P, 459, None, 95),
    (hardware.TPU_V6E, 918, None, 32),
    (hardware.TPU_7X, 2307, 4614, 192),
]


@pytest.mark.parametrize("spec, bf16, fp8, memory_gb", TABLE, ids=lambda v: getattr(v, "name", ""))
def test_table_holds_the_datasheet_figures(spec, bf16, fp8, memory_gb):
    assert (spec.bf16, spec.fp8, spec.memory_gb) == (bf16 * 1e12, fp8 and fp8 * 1e12, memory_gb)
    assert spec.fp32 is None and spec.tf32 is None  # no TPU page prints one
    assert spec in hardware.TPUS


def test_int8_figures_are_in_the_sources():
    assert "int8 393 TOPs" in hardware.TPU_V5E.source and "int8 918 TOPs" in hardware.TPU_V5P.source
    assert "int8 1,836 TOPs" in hardware.TPU_V6E.source and "bf16 or int8" in hardware.TPU_V4.source


@pytest.mark.parametrize(
    "kind, expected",
    [
        # jax's device.device_kind
        ("TPU v4", "TPU v4"),
        ("TPU v5 lite", "TPU v5e"),
        ("TPU v5e", "TPU v5e"),
        ("TPU v5", "TPU v5p"),
        ("TPU v5p", "TPU v5p"),
        ("TPU v6 lite", "TPU v6e"),
        ("TPU v6e", "TPU v6e"),
        ("TPU7x", "TPU7x (Ironwood)"),
        # what users type: `ember plan --device` names, short names, accelerator types, any case
        ("tpu-v4", "TPU v4"),
        ("tpu-v5e", "TPU v5e"),
        ("tpu-v5p", "TPU v5p"),
        ("tpu-v6e", "TPU v6e"),
        ("tpu7x", "TPU7x (Ironwood)"),
        ("v4", "TPU v4"),
        ("v5e", "TPU v5e"),
        ("v5p", "TPU v5p"),
        ("v6e", "TPU v6e"),
        ("7x", "TPU7x (Ironwood)"),
        ("v7x", "TPU7x (Ironwood)"),
        ("TPU v7", "TPU7x (Ironwood)"),
        ("Ironwood", "TPU7x (Ironwood)"),
        ("Trillium", "TPU v6e"),
        ("v6e-256", "TPU v6e"),
        ("v5litepod-16", "TPU v5e"),
        ("v4-8", "TPU v4"),
        ("tpu7x-64", "TPU7x (Ironwood)"),
        (" TPU V6E ", "TPU v6e"),
        # not Cloud TPU chips of the table
        ("TPU v4 lite", None),  # v4i, an inference chip
        ("TPU v3", None),
        ("TPU v2", None),
        ("NVIDIA H100 80GB HBM3", None),  # a GPU in the table, but no TPU
        ("cpu", None),
        ("", None),
    ],
)
def test_tpu_spec_matches_device_kinds_and_user_names(kind, expected):
    spec = tpu_spec(kind)
    assert (spec.name if spec else None) == expected


@pytest.mark.parametrize("kind, bf16", [("TPU v4", 275e12), ("TPU v5 lite", 197e12), ("TPU v5", 459e12),
                                        ("TPU v6 lite", 918e12), ("TPU7x", 2307e12)])
def test_bf16_peak_per_chip(kind, bf16):
    assert tpu_peak_flops(kind, torch.bfloat16, None).value_flops == bf16
    assert tpu_peak_flops(kind, torch.float16, None).value_flops == bf16


def test_the_label_names_the_chip_and_its_source():
    assert tpu_peak_flops("TPU v6 lite", torch.bfloat16, None) == PeakFlops(
        918e12, "TPU v6e bf16 dense (Cloud TPU v6e docs: int8 1,836 TOPs)")


def test_fp8_peak_where_the_page_gives_a_faster_one():
    assert tpu_peak_flops("TPU7x", torch.float8_e4m3fn, None).value_flops == 4614e12
    peak = tpu_peak_flops("TPU v6 lite", torch.float8_e4m3fn, None)
    assert peak == PeakFlops(None, "TPU v6e has no fp8 peak in ember.hardware.peaks: set metrics.peak_tflops")


def test_fp32_has_no_tpu_peak():
    peak = tpu_peak_flops("TPU v5", torch.float32, None)
    assert peak == PeakFlops(None, "TPU v5p has no fp32 peak in ember.hardware.peaks: set metrics.peak_tflops")


def test_unknown_chip_has_no_peak_as_an_unknown_gpu_has_none():
    assert tpu_peak_flops("TPU v3", torch.bfloat16, None) == PeakFlops(
        None, "unknown device 'TPU v3': set metrics.peak_tflops")


def test_metrics_peak_tflops_overrides_known_and_unknown_chips():
    expected = PeakFlops(123e12, "metrics.peak_tflops")
    assert tpu_peak_flops("TPU v3", torch.bfloat16, 123.0) == expected
    assert tpu_peak_flops("TPU v6 lite", torch.bfloat16, 123.0) == expected
    assert tpu_peak_flops("TPU v6 lite", torch.bfloat16) == tpu_peak_flops("TPU v6 lite", torch.bfloat16, None)


def test_a_gpu_under_jax_is_found_by_the_name_jax_gives_it():
    # device=xla on jax's CUDA backend: jax's device_kind is "NVIDIA H200", torch's name for the same card
    assert named_peak_flops("NVIDIA H200", torch.bfloat16) == PeakFlops(
        989.4e12, "NVIDIA H200 SXM bf16 dense (NVIDIA H200 datasheet)")
    assert named_peak_flops("TPU v6 lite", torch.bfloat16) == tpu_peak_flops("TPU v6 lite", torch.bfloat16)
    assert named_peak_flops("Some GPU", torch.bfloat16).value_flops is None
