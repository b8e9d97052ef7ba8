"""Device-name matching, the dense-peak table, the unknown-device and override paths, the CPU measurement."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ember import hardware
from ember.hardware import match_device, peak_flops


@pytest.mark.parametrize(
    "name, expected",
    [
        ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM"),
        ("NVIDIA H100 PCIe", "NVIDIA H100 PCIe"),
        ("NVIDIA H100 NVL", "NVIDIA H100 NVL"),
        ("NVIDIA H200", "NVIDIA H200 SXM"),
        ("NVIDIA H200 NVL", "NVIDIA H200 NVL"),
        ("NVIDIA GH200 480GB", "NVIDIA GH200"),  # contains "H200" but is not one
        ("NVIDIA B200", "NVIDIA B200"),
        ("NVIDIA GB200", "NVIDIA GB200"),  # contains "B200"
        ("NVIDIA A100-SXM4-40GB", "NVIDIA A100 40GB"),
        ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB"),
        ("NVIDIA A100 80GB PCIe", "NVIDIA A100 80GB"),
        ("AMD Instinct MI250X", "AMD Instinct MI250X (one GCD)"),
        ("AMD Instinct MI300X", "AMD Instinct MI300X"),
        ("AMD Instinct MI300X VF", "AMD Instinct MI300X"),
        ("AMD Instinct MI325X", "AMD Instinct MI325X"),
        ("AMD Instinct MI355X", "AMD Instinct MI355X"),
        ("TPU v5 lite", "TPU v5e"),
        ("TPU v5", "TPU v5p"),
        ("TPU v6 lite", "TPU v6e"),
        ("NVIDIA GeForce RTX 4090", None),
        ("Tesla V100-SXM2-16GB", None),
    ],
)
def test_match_device(name, expected):
    spec = match_device(name)
    assert (spec.name if spec else None) == expected


def _specs():
    return [value for value in vars(hardware).values() if isinstance(value, hardware.DeviceSpec)]


def test_table_holds_dense_rates():
    # Dense rates keep the tensor-core ratios: fp8 = 2 x bf16 and tf32 = bf16 / 2 wherever they exist.
    # A "with sparsity" figure copied into one column (and not the other) breaks a ratio.
    assert len(_specs()) >= 17
    for spec in _specs():
        assert spec.bf16 is not None and spec.memory_gb > 0, spec.name
        if spec.fp8 is not None:
            assert spec.fp8 == pytest.approx(2 * spec.bf16, rel=1e-3), spec.name
        if spec.tf32 is not None:
            assert spec.tf32 == pytest.approx(spec.bf16 / 2, rel=1e-3), spec.name
    assert hardware.H100_SXM.bf16 == 989.4e12 and hardware.A100_80GB.bf16 == 312e12
    assert hardware.MI300X.bf16 == 1307.4e12 and hardware.TPU_V5E.bf16 == 197e12


@pytest.fixture
def cuda_named(monkeypatch):
    """Pretend a CUDA device of the given name: peak_flops reads only its name."""

    def set_name(name):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)

    return set_name


def test_peak_flops_h100_per_dtype(cuda_named, monkeypatch):
    cuda_named("NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda")
    peak = peak_flops(cuda, torch.bfloat16, None)
    assert peak.value_flops == 989.4e12
    assert "H100 SXM" in peak.source and "datasheet" in peak.source
    assert peak_flops(cuda, torch.float8_e4m3fn, None).value_flops == 1978.9e12
    monkeypatch.setattr(hardware, "_tf32_allowed", lambda: False)
    assert peak_flops(cuda, torch.float32, None).value_flops == 66.9e12
    monkeypatch.setattr(hardware, "_tf32_allowed", lambda: True)
    assert peak_flops(cuda, torch.float32, None).value_flops == 494.7e12


def test_tf32_allowed_on_a_device_without_tf32_uses_fp32(cuda_named, monkeypatch):
    cuda_named("AMD Instinct MI250X")
    monkeypatch.setattr(hardware, "_tf32_allowed", lambda: True)
    assert peak_flops(torch.device("cuda"), torch.float32, None).value_flops == 47.85e12


def test_tf32_flag_read_without_error():
    assert isinstance(hardware._tf32_allowed(), bool)


def test_unknown_device_has_no_peak(cuda_named):
    cuda_named("NVIDIA GeForce RTX 4090")
    peak = peak_flops(torch.device("cuda"), torch.bfloat16, None)
    assert peak.value_flops is None
    assert peak.source == "unknown device 'NVIDIA GeForce RTX 4090': set metrics.peak_tflops"


def test_missing_precision_has_no_peak(cuda_named):
    cuda_named("NVIDIA A100-SXM4-80GB")  # no fp8 on Ampere
    peak = peak_flops(torch.device("cuda"), torch.float8_e4m3fn, None)
    assert peak.value_flops is None and "metrics.peak_tflops" in peak.source


def test_user_peak_overrides_everything(cuda_named, monkeypatch):
    cuda_named("NVIDIA H100 80GB HBM3")
    assert peak_flops(torch.device("cuda"), torch.bfloat16, 800.0) == hardware.PeakFlops(800e12, "metrics.peak_tflops")

    def no_measuring(*args, **kwargs):
        raise AssertionError("the CPU must not be measured when the user gives a peak")

    monkeypatch.setattr(hardware, "measure_cpu_matmul_flops", no_measuring)
    assert peak_flops(torch.device("cpu"), torch.float32, 0.5).value_flops == 0.5e12


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EMBER_CACHE", str(tmp_path))
    monkeypatch.setattr(hardware, "_PEAK_IN_PROCESS", {})
    return tmp_path / "hardware" / "cpu-peak.json"


def test_cpu_peak_is_measured_once_per_machine_and_cached(fresh_cache: Path, monkeypatch: pytest.MonkeyPatch):
    calls = []
    monkeypatch.setattr(hardware, "measure_cpu_matmul_flops", lambda: calls.append(1) or 1.5e11)
    peak = peak_flops(torch.device("cpu"), torch.float32, None)
    assert peak.value_flops == 1.5e11 and peak.measured and calls == [1]
    assert peak.source.startswith("measured CPU fp32 matmul") and str(fresh_cache) in peak.source
    key = f"{hardware.cpu_model()} | {torch.get_num_threads()} threads | torch {torch.__version__}"
    assert json.loads(fresh_cache.read_text()) == {key: 1.5e11}  # keyed by the CPU model, threads, torch
    monkeypatch.setattr(hardware, "_PEAK_IN_PROCESS", {})  # a new process: reads the file, measures nothing
    assert peak_flops(torch.device("cpu"), torch.float32, None).value_flops == 1.5e11 and calls == [1]


def test_a_damaged_cache_is_measured_again(fresh_cache: Path, monkeypatch: pytest.MonkeyPatch):
    fresh_cache.parent.mkdir(parents=True)
    fresh_cache.write_text("{not json")
    monkeypatch.setattr(hardware, "measure_cpu_matmul_flops", lambda: 2e11)
    assert hardware.cpu_peak_flops()[0] == 2e11
    assert list(json.loads(fresh_cache.read_text()).values()) == [2e11]


def test_ranks_starting_together_measure_once(tmp_path: Path):
    # Three processes at once, as torchrun starts a node's ranks: the file lock lets one measure (slowly
    # here) while the others wait, then read its number.
    counter = tmp_path / "measured"
    code = ("import time, ember.hardware as h\n"
            "def slow():\n"
            f"    open({str(counter)!r}, 'a').write('x')\n"
            "    time.sleep(1.0)\n"
            "    return 3e11\n"
            "h.measure_cpu_matmul_flops = slow\n"
            "print(h.cpu_peak_flops()[0])\n")
    env = {**os.environ, "EMBER_CACHE": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert outputs == ["300000000000.0"] * 3 and counter.read_text() == "x"


def test_a_measured_peak_that_a_run_beats_is_raised(fresh_cache: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(hardware, "measure_cpu_matmul_flops", lambda: 1e11)
    peak = peak_flops(torch.device("cpu"), torch.float32, None)
    assert hardware.raise_measured_peak(peak, 0.9e11) is peak  # slower than the peak: unchanged
    raised = hardware.raise_measured_peak(peak, 1.2e11)
    assert raised.value_flops == 1.2e11 and "raised to a training run's rate" in raised.source
    assert list(json.loads(fresh_cache.read_text()).values()) == [1.2e11]  # the next run starts from it
    given = hardware.PeakFlops(1e11, "metrics.peak_tflops")
    assert hardware.raise_measured_peak(given, 5e11) is given  # the user's number is the user's


def test_real_cpu_measurement_is_plausible():
    rate = hardware.measure_cpu_matmul_flops(seconds=0.05, sizes=(256,))
    assert 1e9 < rate < 1e15  # above a GFLOP/s, below any CPU that exists


def test_device_spec_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        hardware.H100_SXM.bf16 = 1.0
