"""MFU of real runs against this machine's measured CPU peak.

`0 < mfu <= 1` proves nothing here: a run that beats a measured peak raises it (hardware.raise_measured_peak), so
MFU stays within 1 whatever the measurement said. What can fail: a quiet measurement is the machine's matmul peak,
so a run's model FLOP rate stays below the measurement itself and the trainer never raises it; and a measurement
taken while other processes kept the cores busy is provisional and measured again by the next job. The contention
signal (`cpu_rates.busy_elsewhere`, read from /proc/stat) is faked, so both paths run on every machine, loaded or not.
Faking "quiet" on a loaded machine does not make the comparison fragile: the measurement keeps the best of many
matmuls, which on this project's 2-core CPU read 0.37-0.40 TFLOP/s with none, three spinning processes or two torch
matmul loops beside it, while this run's quiet rate is ~0.21 TFLOP/s (~55% MFU) and a loaded run's is lower.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ember.hardware import cpu_rates
from ember.train import run as run_lib
from ember.train.trainer import Trainer
from tests.helpers import read_records

# Both tests train and measure the CPU's peak.
pytestmark = pytest.mark.slow


@pytest.fixture
def measurements(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """A machine seen for the first time (an empty peak cache); every real measurement's rate, in order."""
    monkeypatch.setenv("EMBER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_rates, "_IN_PROCESS", {})
    rates: list[float] = []
    real = cpu_rates.measure_cpu_matmul_flops

    def counted(dtype=None) -> float:
        rates.append(real(dtype=dtype))
        return rates[-1]

    monkeypatch.setattr(cpu_rates, "measure_cpu_matmul_flops", counted)
    return rates


def _contention(monkeypatch: pytest.MonkeyPatch, cores: float) -> None:
    """Other processes kept `cores` cores busy during any measurement from now on."""
    monkeypatch.setattr(cpu_rates, "busy_elsewhere", lambda before, wall_s: cores)


def _trainer(out: Path, steps: int) -> Trainer:
    # fp32 on every CPU: full training never computes in bf16 on CPU, so the fp32 peak is the one measured.
    cfg = run_lib.load_config("debug", [f"max_steps={steps}", "logging_steps=1", "data.dataset=synthetic",
                                "model.n_layers=2", "metrics.console=false", "precision=fp32", f"output_dir={out}"])
    return Trainer(cfg)


def _step_records(out: Path) -> list[dict]:
    return [r for r in read_records(out) if "mfu" in r]


def _cached_entry() -> dict:
    (entry,) = json.loads(cpu_rates.rates_path().read_text()).values()
    return entry


def test_a_quiet_peak_is_above_a_real_runs_matmul_rate_and_is_not_raised(
        tmp_path: Path, measurements: list[float], monkeypatch: pytest.MonkeyPatch):
    _contention(monkeypatch, 0.0)
    trainer = _trainer(tmp_path / "run", 6)
    peak = trainer.peak
    assert peak.measured and len(measurements) == 1 and peak.value_flops == measurements[0]
    assert "other processes were busy" not in peak.source
    trainer.train()
    steps = _step_records(tmp_path / "run")
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    # The run's model FLOPs are matmul FLOPs: its rate stays below the measured matmul peak. A peak measured too
    # low (the bug that printed MFU 91-124%) fails here.
    assert all(r["tflops_per_device"] * 1e12 < peak.value_flops for r in steps), (steps, peak)
    # ... so the trainer's guard never stepped in: the same peak in the trainer and the cache, MFU against it.
    assert trainer.peak == peak and len(measurements) == 1
    assert _cached_entry() == {"rates": {"fp32": peak.value_flops}, "quiet": True, "job": cpu_rates.job_id()}
    for r in steps:
        assert r["mfu"] == pytest.approx(r["tflops_per_device"] * 1e12 / peak.value_flops, rel=1e-12)


def test_a_provisional_peak_is_measured_again_by_the_next_job(
        tmp_path: Path, measurements: list[float], monkeypatch: pytest.MonkeyPatch):
    job = ["job-1"]
    monkeypatch.setattr(cpu_rates, "job_id", lambda: job[0])
    _contention(monkeypatch, 1.5)  # 1.5 cores kept busy elsewhere: over cpu_rates.QUIET_CORES
    busy = _trainer(tmp_path / "busy", 2)
    assert len(measurements) == 1 and busy.peak.value_flops == measurements[0]
    assert "measured while other processes were busy: provisional" in busy.peak.source
    busy.train()
    for r in _step_records(tmp_path / "busy"):  # the job divides by its provisional figure meanwhile
        assert r["mfu"] == pytest.approx(r["tflops_per_device"] * 1e12 / busy.peak.value_flops, rel=1e-12)
    assert _cached_entry() == {"rates": {"fp32": measurements[0]}, "quiet": False, "job": "job-1"}

    # Another rank of the same job (a new process) uses the job's figure: nothing is measured.
    monkeypatch.setattr(cpu_rates, "_IN_PROCESS", {})
    assert _trainer(tmp_path / "rank1", 2).peak.value_flops == measurements[0] and len(measurements) == 1

    # The next job measures again, on a quiet machine now; the higher figure is kept and settles the entry.
    job[0] = "job-2"
    _contention(monkeypatch, 0.0)
    monkeypatch.setattr(cpu_rates, "_IN_PROCESS", {})
    quiet = _trainer(tmp_path / "quiet", 2)
    assert len(measurements) == 2
    assert quiet.peak.value_flops == max(measurements) and "busy" not in quiet.peak.source
    assert _cached_entry() == {"rates": {"fp32": max(measurements)}, "quiet": True, "job": "job-2"}

    # Settled: a later job, busy or not, measures nothing.
    job[0] = "job-3"
    _contention(monkeypatch, 1.5)
    monkeypatch.setattr(cpu_rates, "_IN_PROCESS", {})
    assert _trainer(tmp_path / "later", 2).peak.value_flops == max(measurements) and len(measurements) == 2
