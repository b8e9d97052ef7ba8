"""precision=auto trains in bf16 autocast on a CPU whose bf16 matmuls measured faster (EMBER_CPU_BF16=1 here, which
declares it; tests/hardware/test_cpu_precision.py fakes the measurements), says so in the header, and
the default run's losses under it stay within 1% of fp32's at every logged step (benchmarks/bf16_parity.py,
whose bf16 matmuls are computed as a bf16 CPU computes them where this one has no bf16 instructions)."""

import pytest
import torch

from ember.train import run as run_lib
from tests.helpers import TINY_RUN, load_benchmark, run_ember

# the tiny run with its console on: the header is what is asserted
TINY_CONSOLE = [o for o in TINY_RUN if o != "metrics.console=false"]


@pytest.mark.parametrize("native", ["1", "0"])
def test_auto_follows_the_cpus_bf16_instructions(native, monkeypatch):
    monkeypatch.setenv("EMBER_CPU_BF16", native)
    cfg = run_lib.load_config("debug", [])
    spec = run_lib.resolve(cfg, 1, torch.device("cpu"))
    assert spec.compute_dtype == (torch.bfloat16 if native == "1" else torch.float32)
    spec = run_lib.resolve(run_lib.load_config("debug", ["precision=fp32"]), 1, torch.device("cpu"))
    assert spec.compute_dtype == torch.float32  # the opt-out


@pytest.mark.slow
def test_the_header_says_which_precision_runs_and_why(tmp_path):
    import os

    env = dict(os.environ, EMBER_CPU_BF16="1")
    proc = run_ember("train", *TINY_CONSOLE, "max_steps=1", f"output_dir={tmp_path / 'run'}", env=env, expect=0)
    assert "| cpu bfloat16 |" in proc.stdout
    assert ("precision: auto -> bf16 autocast (EMBER_CPU_BF16=1 declares bf16 matmul instructions, not measured; "
            "fp32 weights, gradients and optimizer state); precision=fp32 opts out") in proc.stdout
    proc = run_ember("train", *TINY_CONSOLE, "max_steps=1", "precision=fp32", f"output_dir={tmp_path / 'fp32'}",
                     env=env, expect=0)
    assert "| cpu float32 |" in proc.stdout and "precision: auto" not in proc.stdout


def test_the_emulated_bf16_matmul_is_the_bf16_products_summed_in_fp32():
    """The emulation the parity run uses on this CPU: bf16 operands, fp32 sums, a bf16 result."""
    parity = load_benchmark("bf16_parity")
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 64, generator=g).bfloat16(), torch.randn(64, 16, generator=g).bfloat16()
    with parity.NativeBf16Matmuls():
        got = a @ b
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, (a.double() @ b.double()).float().bfloat16())  # exact products; fp32-close sums


@pytest.mark.slow
def test_default_run_losses_under_auto_bf16_stay_within_one_percent_of_fp32():
    """The debug recipe, its whole schedule compressed into 40 steps (warm-up 20, then the cosine decay), once in
    fp32 and once under precision=auto on a bf16 CPU: every logged loss and the validation loss within 1%."""
    parity = load_benchmark("bf16_parity")
    result = parity.parity(40, emulate=True)
    assert (result["fp32"]["compute_dtype"], result["bf16"]["compute_dtype"]) == ("float32", "bfloat16")
    assert sorted(result["per_step_rel"]) == [10, 20, 30, 40]
    assert result["max_step_rel"] <= 0.01, result["per_step_rel"]
    assert result["val_rel"] <= 0.01
    assert result["fp32"]["losses"][40] < result["fp32"]["losses"][10] - 1  # a run that learned, not a flat line


@pytest.mark.slow
def test_a_resume_keeps_the_dtype_the_run_trained_in_where_auto_would_choose_another(tmp_path):
    """Trained under precision=auto where it meant fp32, resumed where auto means bf16 (another machine, or this
    CPU measured again while busy; here EMBER_CPU_BF16): the resume keeps fp32 and says why, and its losses are
    the straight fp32 run's, bit for bit."""
    import json
    import os

    fp32_env, bf16_env = dict(os.environ, EMBER_CPU_BF16="0"), dict(os.environ, EMBER_CPU_BF16="1")
    every_step = [*TINY_RUN, "logging_steps=1"]
    out, straight = tmp_path / "run", tmp_path / "straight"
    run_ember("train", *every_step, "max_steps=3", f"output_dir={straight}", env=fp32_env, expect=0)
    run_ember("train", *every_step, "max_steps=2", f"output_dir={out}", env=fp32_env, expect=0)
    proc = run_ember("train", *TINY_CONSOLE, "logging_steps=1", "max_steps=3", f"output_dir={out}", env=bf16_env,
                     expect=0)
    assert "| cpu float32 |" in proc.stdout
    assert "precision: auto -> fp32 (kept from the run this resumes, run.json's compute: not measured again)" \
        in proc.stdout
    assert json.loads((out / "run.json").read_text())["compute"] == "float32"

    def losses(run):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if "loss" in r}

    assert losses(out) == losses(straight) and len(losses(straight)) == 3
    # a run that starts over measures (declares) afresh
    proc = run_ember("train", *TINY_CONSOLE, "max_steps=1", "resume=none", f"output_dir={out}", env=bf16_env, expect=0)
    assert "| cpu bfloat16 |" in proc.stdout
