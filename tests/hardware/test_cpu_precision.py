"""precision=auto on a CPU chooses by measurement, not by the CPU's flags: bf16 only where this CPU's bf16 matmuls
ran at least 1.2x fp32's at the model's own GEMM shapes (ember.hardware.device.choose_compute_dtype,
ember.hardware.cpu_rates). Each outcome is faked (an AVX512-BF16 Xeon without AMX at 0.5x, an AMX or Zen 4 CPU at
2.9x, a near tie), so every machine runs every branch; one test times the real kernels for plausibility only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ember.hardware import cpu_rates, device, peaks as hardware
from ember.metrics.run_metrics import format_line, throughput_record
from ember.train import run as run_lib

CPU = torch.device("cpu")


@pytest.fixture
def bf16_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[list[cpu_rates.Gemm]]:
    """A CPU with bf16 matmul instructions, nothing declared, an empty cache on a quiet machine; the GEMM sets
    measured, in order (fill in the rates with `_rates`)."""
    monkeypatch.delenv("EMBER_CPU_BF16", raising=False)
    monkeypatch.setattr(device, "cpu_runs_bf16_natively", lambda: True)
    monkeypatch.setenv("EMBER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_rates, "_IN_PROCESS", {})
    monkeypatch.setattr(cpu_rates, "busy_elsewhere", lambda before, wall_s: 0.0)
    return []


def _rates(monkeypatch: pytest.MonkeyPatch, measured: list, fp32: float, bf16: float) -> None:
    def fake(gemms, dtypes, training=True):
        measured.append((gemms, training))
        return {torch.float32: fp32, torch.bfloat16: bf16}

    monkeypatch.setattr(cpu_rates, "measure_gemm_rates", fake)


@pytest.mark.parametrize("fp32, bf16, expected", [
    (0.305e12, 0.162e12, torch.float32),  # an AVX512-BF16 Xeon without AMX: bf16 at 0.53x
    (0.210e12, 0.612e12, torch.bfloat16),  # AMX / an AVX512-BF16 EPYC: 2.9x
    (0.300e12, 0.330e12, torch.float32),  # 1.1x: not worth autocast's casts
    (0.300e12, 0.360e12, torch.bfloat16),  # 1.2x: the threshold takes it
])
def test_auto_takes_the_dtype_that_measured_faster_at_the_models_shapes(bf16_cpu, monkeypatch, fp32, bf16, expected):
    _rates(monkeypatch, bf16_cpu, fp32, bf16)
    spec = run_lib.resolve(run_lib.load_config("debug", []), 1, CPU)
    assert spec.compute_dtype == expected
    ratio = f"bf16 matmuls ran {bf16 / fp32:.2f}x fp32's at this model's shapes on this CPU: {bf16 / 1e12:.3f} " \
            f"TFLOP/s vs {fp32 / 1e12:.3f} TFLOP/s, cached in "
    assert ratio in spec.precision_note  # the two rates that decided
    if expected == torch.bfloat16:
        assert spec.precision_note.startswith("precision: auto -> bf16 autocast (bf16 matmuls ran")
        assert spec.precision_note.endswith("; fp32 weights, gradients and optimizer state); precision=fp32 opts out")
    else:
        assert spec.precision_note.startswith("precision: auto -> fp32 (bf16 matmuls ran")
        assert spec.precision_note.endswith("; auto takes bf16 from 1.2x, precision=bf16 forces it)")
    # measured at the debug model's training GEMMs on one micro-batch's tokens (8 x 256)
    ((gemms, training),) = bf16_cpu
    assert training and all(g.tokens == 2048 for g in gemms)
    assert {(g.in_features, g.out_features) for g in gemms} >= {(256, 256), (256, 704), (704, 256)}
    # once per machine: a second resolve (another run, another process's cache read) measures nothing
    monkeypatch.setattr(cpu_rates, "_IN_PROCESS", {})
    assert run_lib.resolve(run_lib.load_config("debug", []), 1, CPU).compute_dtype == expected
    assert len(bf16_cpu) == 1
    # explicit precisions are kept without measuring
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        spec = run_lib.resolve(run_lib.load_config("debug", [f"precision={precision}"]), 1, CPU)
        assert (spec.compute_dtype, spec.precision_note) == (dtype, None)
    assert len(bf16_cpu) == 1


@pytest.mark.parametrize("bad", [{"fp32": 0.0, "bf16": 1e11}, {"fp32": float("nan"), "bf16": 1e11},
                                 {"fp32": -1e11, "bf16": -1e11}, {"fp32": 1e11}])
def test_a_cached_rate_that_is_no_rate_is_measured_again(bf16_cpu, monkeypatch, bad):
    _rates(monkeypatch, bf16_cpu, 3e11, 1e11)
    run_lib.resolve(run_lib.load_config("debug", []), 1, CPU)
    path = cpu_rates.rates_path()
    entries = json.loads(path.read_text())
    (key,) = entries
    path.write_text(json.dumps({key: {"rates": bad, "quiet": True, "job": "x"}}).replace("NaN", "NaN"))
    monkeypatch.setattr(cpu_rates, "_IN_PROCESS", {})
    spec = run_lib.resolve(run_lib.load_config("debug", []), 1, CPU)
    assert len(bf16_cpu) == 2 and spec.compute_dtype == torch.float32 and "0.33x" in spec.precision_note


def test_decode_rates_are_said_in_gflops():
    assert device._rate(7e7) == "0.07 GFLOP/s" and device._rate(3.2e11) == "0.320 TFLOP/s"


def test_a_cpu_without_bf16_instructions_is_fp32_unmeasured(bf16_cpu, monkeypatch):
    _rates(monkeypatch, bf16_cpu, 1e11, 9e11)
    monkeypatch.setattr(device, "cpu_runs_bf16_natively", lambda: False)
    spec = run_lib.resolve(run_lib.load_config("debug", []), 1, CPU)
    assert spec.compute_dtype == torch.float32 and bf16_cpu == []  # emulated bf16 is never timed
    assert spec.precision_note == "precision: auto -> fp32 (this CPU has no bf16 matmul instructions: AVX512-BF16, AMX)"


@pytest.mark.parametrize("cap, native", [("AVX2", False), ("avx512_core_vnni", False), ("AVX512_CORE_BF16", True),
                                         ("AVX512_CORE_AMX", True), ("", True)])
def test_a_onednn_cap_below_bf16_is_a_cpu_without_bf16_instructions(monkeypatch, cap, native):
    monkeypatch.delenv("EMBER_CPU_BF16", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_bf16": True, "amx_bf16": True}, raising=False)
    assert device.cpu_runs_bf16_natively() is native
    if not native:
        choice = device.choose_compute_dtype("auto", CPU, lambda: [])
        assert choice == device.PrecisionChoice(
            torch.float32, f"ONEDNN_MAX_CPU_ISA={cap.upper()} holds oneDNN below bf16 matmul instructions")


@pytest.mark.parametrize("declared, expected", [("1", torch.bfloat16), ("0", torch.float32)])
def test_ember_cpu_bf16_declares_the_answer_unmeasured(bf16_cpu, monkeypatch, declared, expected):
    _rates(monkeypatch, bf16_cpu, 1e11, 0.5e11)
    monkeypatch.setenv("EMBER_CPU_BF16", declared)
    spec = run_lib.resolve(run_lib.load_config("debug", []), 1, CPU)
    assert spec.compute_dtype == expected and bf16_cpu == []
    assert f"EMBER_CPU_BF16={declared} declares" in spec.precision_note and "not measured" in spec.precision_note


def test_a_provisional_measurement_is_said_and_measured_again_by_the_next_job(bf16_cpu, monkeypatch):
    job = ["job-1"]
    monkeypatch.setattr(cpu_rates, "job_id", lambda: job[0])
    monkeypatch.setattr(cpu_rates, "busy_elsewhere", lambda before, wall_s: 1.5)
    _rates(monkeypatch, bf16_cpu, 0.3e12, 0.2e12)
    spec = run_lib.resolve(run_lib.load_config("debug", []), 1, CPU)
    assert spec.compute_dtype == torch.float32
    assert "measured while other processes were busy: provisional" in spec.precision_note
    job[0] = "job-2"
    monkeypatch.setattr(cpu_rates, "_IN_PROCESS", {})
    monkeypatch.setattr(cpu_rates, "busy_elsewhere", lambda before, wall_s: 0.0)
    _rates(monkeypatch, bf16_cpu, 0.25e12, 0.9e12)  # contention had slowed bf16; each rate keeps its best
    spec = run_lib.resolve(run_lib.load_config("debug", []), 1, CPU)
    assert len(bf16_cpu) == 2 and spec.compute_dtype == torch.bfloat16
    assert "other processes were busy" not in spec.precision_note and "3.00x" in spec.precision_note  # 0.9 vs 0.3


def test_the_planner_on_this_cpu_takes_the_trainers_choice(bf16_cpu, monkeypatch, tmp_path):
    from ember.plan.planner import compute_dtype

    _rates(monkeypatch, bf16_cpu, 0.305e12, 0.162e12)
    assert compute_dtype(run_lib.load_config("debug", []), "cpu") == torch.float32
    _rates(monkeypatch, bf16_cpu, 0.2e12, 0.6e12)  # another machine: its own cache
    monkeypatch.setattr(cpu_rates, "_IN_PROCESS", {})
    monkeypatch.setenv("EMBER_CACHE", str(tmp_path / "another"))
    assert compute_dtype(run_lib.load_config("debug", []), "cpu") == torch.bfloat16


def test_model_gemms_are_its_weight_matrices_on_a_batch_of_tokens():
    from ember.models import MODELS

    cfg = run_lib.load_config("debug", ["model.family=mixtral", "model.n_experts=4", "model.top_k=2"])
    with torch.device("meta"):
        model = MODELS["mixtral"].model_cls(run_lib.model_choice(cfg).args)
    gemms = cpu_rates.model_gemms(model, 4096)
    assert all(g.tokens == cpu_rates.GEMM_DIM_CAP for g in gemms)  # capped
    counts = {(g.in_features, g.out_features): g.count for g in gemms}
    n_layers = cfg.model.n_layers or run_lib.model_choice(cfg).args.n_layers
    dim = run_lib.model_choice(cfg).args.dim
    assert counts[(dim, cpu_rates.GEMM_DIM_CAP)] == 2  # the embedding table and the untied output, vocab capped
    assert sum(g.count for g in gemms) == sum(1 for p in model.parameters() if p.dim() >= 2)
    assert n_layers >= 1
    assert cpu_rates.model_gemms(model, 3)[0].tokens == 3  # a decode step's batch


def test_real_gemm_rates_are_plausible_and_both_dtypes_are_timed():
    gemms = [cpu_rates.Gemm(64, 128, 96, 2)]
    rates = cpu_rates.measure_gemm_rates(gemms, (torch.float32, torch.bfloat16), seconds=0.0, repeats=2)
    assert set(rates) == {torch.float32, torch.bfloat16}
    assert all(1e6 < rate < 1e15 for rate in rates.values())


# --- MFU: which peak, and a provisional one beaten -------------------------------------------------------------

@pytest.fixture
def provisional_peak(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """A first measurement taken while other processes were busy; the rates every measurement returns, in order."""
    monkeypatch.setenv("EMBER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_rates, "_IN_PROCESS", {})
    busy = iter([1.5, 0.0, 0.0])
    monkeypatch.setattr(cpu_rates, "busy_elsewhere", lambda before, wall_s: next(busy))
    rates: list[float] = []
    monkeypatch.setattr(cpu_rates, "measure_cpu_matmul_flops", lambda dtype=None: rates.pop(0))
    return rates


def test_a_provisional_peak_a_run_beats_is_measured_again_not_printed_as_100(provisional_peak):
    provisional_peak += [1e11, 3e11]  # busy: 0.1 TFLOP/s; quiet again: 0.3
    peak = hardware.peak_flops(CPU, torch.float32)
    assert peak.provisional and peak.value_flops == 1e11 and peak.describe()["provisional"] is True
    raised = hardware.raise_measured_peak(peak, 2e11)  # the run beat it: measured again, quietly
    assert raised.value_flops == 3e11 and not raised.provisional and not raised.run_rate
    record = throughput_record(step=1, loss=1.0, lr=1e-3, grad_norm=1.0, window_time=1.0, window_steps=1,
                               window_loss=1.0, window_data_wait=0.0, tokens_per_step=1000, world_size=1,
                               flops_per_token=2e8, peak=raised, device=CPU)
    assert record["mfu"] == pytest.approx(2 / 3) and record["mfu_peak_tflops"] == pytest.approx(0.3)
    assert "MFU 66.7%  " in format_line(1, record) + "  " and not record["mfu_provisional"]


def test_a_run_still_faster_than_the_remeasured_peak_is_marked(provisional_peak):
    provisional_peak += [1e11, 1.5e11]
    peak = hardware.peak_flops(CPU, torch.float32)
    raised = hardware.raise_measured_peak(peak, 2e11)
    assert raised.value_flops == 2e11 and raised.run_rate and "raised to a training run's rate" in raised.source
    record = throughput_record(step=1, loss=1.0, lr=1e-3, grad_norm=1.0, window_time=1.0, window_steps=1,
                               window_loss=1.0, window_data_wait=0.0, tokens_per_step=1000, world_size=1,
                               flops_per_token=2e8, peak=raised, device=CPU)
    assert record["mfu"] == pytest.approx(1.0) and record["mfu_provisional"] is True
    assert "MFU 100.0%?" in format_line(1, record)  # never a bare 100%
    assert raised.describe() == {"tflops": pytest.approx(0.2), "source": raised.source, "dtype": "fp32",
                                 "provisional": True}


@pytest.mark.slow
def test_run_json_names_the_peak_mfu_divides_by(tmp_path: Path):
    from tests.helpers import TINY_RUN, run_ember

    run_ember("train", *TINY_RUN, "max_steps=1", "metrics.peak_tflops=0.5", f"output_dir={tmp_path}", expect=0)
    info = json.loads((tmp_path / "run.json").read_text())
    assert info["mfu_peak"] == {"tflops": 0.5, "source": "metrics.peak_tflops", "dtype": None, "provisional": False}
    (record,) = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "mfu" in r]
    assert record["mfu_peak_tflops"] == 0.5 and record["mfu_provisional"] is False
