"""The run header and run.json say what runs: the model that was built (a fine-tune's comes from model.init_from,
whatever flavor its recipe names) and what the steps compute in (FP8's recipe and emulation included)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

import ember.metrics.run_metrics
from ember import config as config_lib
from ember.config import ConfigError
from ember.models import MODELS
from ember.report import build_report
from ember.train import run as run_lib
from ember.train.trainer import Trainer
from tests.helpers import tiny_model

TINY = [*tiny_model(), "seq_len=32", "global_batch_size=2", "micro_batch_size=2", "data.dataset=synthetic",
        "eval_batches=1", "max_steps=1", "metrics.tensorboard=false"]


def _run(output_dir: Path, *overrides: str) -> str:
    """A one-step run in this process; returns what it printed."""
    out = io.StringIO()
    cfg = run_lib.load_config("debug", TINY + [f"output_dir={output_dir}", *overrides])
    Trainer(cfg, console=Console(file=out, width=400, soft_wrap=True)).train()
    return out.getvalue()


def test_a_fine_tune_names_the_model_it_built(tmp_path: Path):
    source, tuned = tmp_path / "source", tmp_path / "tuned"
    _run(source)
    # The recipe names 8B; the architecture (and the weights) are the source's 1-layer model.
    printed = _run(tuned, "model.flavor=8B", f"model.init_from={source}")
    params = json.loads((source / "run.json").read_text())["params"]
    assert printed.splitlines()[0].startswith(f"ember train llama3 (from {source}): {params:,} params, 1 layer, "
                                              "dim 64, ")
    assert "\ndone: 1 step, loss " in printed  # counts are singular at 1

    info = json.loads((tuned / "run.json").read_text())
    source_meta = json.loads((source / "checkpoints" / "step-1" / "model.json").read_text())
    assert info["params"] == params
    assert info["model"] == {**source_meta, "init_from": str(source),
                             "architecture_from": str(source / "checkpoints" / "step-1" / "model.json")}

    # config.yaml keeps what the user gave (model.flavor: 8B); the report compares the models that were built.
    assert (tuned / "config.yaml").read_text().count("flavor: 8B") == 1
    report = build_report([source, tuned], output=tmp_path / "report.html")
    differences = json.loads(report.html.read_text().split('id="ember-report-data">')[1].split("</script>")[0])[
        "config_differences"]
    assert {k: v for k, v in differences.items() if k.startswith("model.")} == {"model.init_from": [None, str(source)]}
    assert [run.summary()["model"] for run in report.runs] == [f"llama3 debug: {params:,} params",
                                                               f"llama3 (from {source}): {params:,} params"]


def test_the_header_says_fp8_and_its_emulation(tmp_path: Path):
    printed = _run(tmp_path, "precision=fp8", "fp8.emulate=true")
    compute = "fp8 tensorwise (emulated in bfloat16) in 7 of 8 linears, bfloat16 elsewhere"  # the output head kept
    assert f" | cpu {compute} | " in printed.splitlines()[0]
    info = json.loads((tmp_path / "run.json").read_text())
    assert info["compute"] == compute
    # and every decision ember.train.run.resolve made, as it made them
    assert {k: info["decisions"][k] for k in ("fp8", "compute_dtype", "mesh", "world_size", "loss_parallel")} == {
        "fp8": "tensorwise", "compute_dtype": "bfloat16", "mesh": info["mesh"], "world_size": 1, "loss_parallel": False}


def test_fp8_emulate_without_fp8_is_refused():
    with pytest.raises(ConfigError) as info:
        run_lib.load_config("debug", ["fp8.emulate=true"])
    assert str(info.value) == ("fp8.emulate=true emulates FP8 training, which this run does not turn on: add "
                               "precision=fp8 (or fp8.enabled=true), or drop fp8.emulate")
    assert config_lib.fp8_enabled(run_lib.load_config("debug", ["fp8.enabled=true", "fp8.emulate=true"]))


def test_the_header_comes_first_on_a_resume_and_a_start_over(tmp_path: Path):
    _run(tmp_path)
    resumed = _run(tmp_path, "max_steps=2", "optim.lr=0.001").splitlines()
    started_over = _run(tmp_path, "resume=none").splitlines()
    for lines, said in ((resumed, "resumed from "), (resumed, "changed on resume"), (started_over, "started over")):
        assert lines[0].startswith("ember train llama3 debug: "), lines[:3]
        assert any(line.startswith(said) for line in lines[1:]), (said, lines)


def test_a_warmup_longer_than_the_run_is_said(tmp_path: Path):
    printed = _run(tmp_path, "schedule.warmup_steps=5")  # a one-step run
    assert ("note: schedule.warmup_steps=5 >= max_steps=1: the learning rate is still warming up at the last step "
            "and never reaches optim.lr=") in printed
    assert "warming up" not in _run(tmp_path / "b", "schedule.warmup_steps=0")


def test_an_moe_header_gives_active_parameters_and_emulated_bf16_is_said(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(ember.metrics.run_metrics, "cpu_runs_bf16_natively", lambda: False)  # this CPU's answer, fixed
    printed = _run(tmp_path, "model.family=mixtral", "model.n_experts=4", "model.top_k=1", "precision=bf16")
    info = json.loads((tmp_path / "run.json").read_text())

    spec = run_lib.resolve(run_lib.load_config("debug", TINY + ["model.family=mixtral", "model.n_experts=4",
                                                                "model.top_k=1"]), 1, torch.device("cpu"))
    with torch.device("meta"):
        active = MODELS["mixtral"].active_params(MODELS["mixtral"].model_cls(spec.args))
    assert f": {info['params']:,} params ({active:,} active), 1 layer, " in printed.splitlines()[0]
    assert active < info["params"]
    assert ("\nnote: precision=bf16 on a CPU without bf16 matmul instructions (AVX512-BF16, AMX): torch emulates "
            "them, many times slower than fp32; precision=fp32 (or auto) trains faster here\n") in printed
