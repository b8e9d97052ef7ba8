"""ember.xla.cpu_rates: XLA:CPU's own matmul rate, measured on jax's CPU device and cached beside torch's rates
under the jaxlib release (a new jaxlib's XLA is measured afresh)."""

import json
from importlib import metadata
from pathlib import Path

import pytest
import torch

from ember.hardware import cpu_rates
from ember.xla import cpu_rates as xla_rates


def test_the_rate_is_a_real_measurement_of_jitted_products():
    rate = xla_rates.measure_xla_matmul_flops(torch.float32, seconds=0.02, sizes=(64, 128))
    assert 1e6 < rate < 1e14  # FLOP/s of a CPU: above a megaflop, below any CPU's peak


def test_the_rate_is_cached_once_per_machine_and_jaxlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("EMBER_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_rates, "_IN_PROCESS", {})
    monkeypatch.setattr(cpu_rates, "busy_elsewhere", lambda before, wall_s: 0.0)  # a quiet machine
    calls = []
    monkeypatch.setattr(xla_rates, "measure_xla_matmul_flops", lambda dtype: calls.append(dtype) or 2e11)
    assert xla_rates.xla_cpu_peak_flops(torch.float32).rates == {"fp32": 2e11}
    monkeypatch.setattr(cpu_rates, "_IN_PROCESS", {})  # a new process: reads the file, measures nothing
    assert xla_rates.xla_cpu_peak_flops(torch.float32).rates == {"fp32": 2e11} and calls == [torch.float32]
    (key,) = json.loads((tmp_path / "hardware" / "cpu-rates.json").read_text())
    assert f"xla:cpu jaxlib {metadata.version('jaxlib')} | peak fp32" in key
