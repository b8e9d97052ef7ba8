"""Profiling: the traces of the asked steps exist on every rank, parse, hold ember's phase ranges, and do not
change the run's numbers; the summary's shares and exposed communication are computed from the trace."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from ember.metrics.profiling import StepProfiler, category, exposed_time, without_kineto_notices
from tests.helpers import read_records, run_ember, tiny_model

TINY = [*tiny_model(), "seq_len=32", "global_batch_size=4", "max_steps=6", "logging_steps=1", "eval_batches=1",
        "checkpoint.interval=4"]


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_records(run) if "loss" in r]


def _range_names(trace: Path) -> set[str]:
    events = json.loads(trace.read_text())["traceEvents"]
    return {e["name"] for e in events if e.get("name", "").startswith("ember/")}


def test_exposed_time_and_categories():
    # communication [0, 10) and [20, 30); computation [5, 12) and [18, 22): exposed [0, 5) and [22, 30)
    assert exposed_time([(0, 10), (20, 30)], [(5, 12), (18, 22)]) == pytest.approx(13)
    assert exposed_time([(0, 10)], [(0, 4), (2, 6)]) == pytest.approx(4)  # overlapping computation counted once
    assert exposed_time([(0, 10)], []) == 10 and exposed_time([], [(0, 1)]) == 0
    assert [category(n) for n in ("aten::mm", "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
                                  "c10d::allreduce_", "ncclDevKernel_AllGather_RING_LL", "aten::mul_")] == \
        ["matmul", "attention", "communication", "communication", "other"]


@pytest.mark.slow
def test_traced_steps_hold_the_phases_and_leave_the_numbers_alone(tmp_path: Path):
    plain, traced = tmp_path / "plain", tmp_path / "traced"
    assert run_ember("train", "debug", *TINY, "micro_batch_size=4", "metrics.console=false",
                     f"output_dir={plain}").returncode == 0
    proc = run_ember("train", "debug", *TINY, "micro_batch_size=2", "profile_step=3", "profile_duration=2",
                     f"output_dir={traced}")
    assert proc.returncode == 0, proc.stderr
    assert "USDT:" not in proc.stderr and "profiler_start" not in proc.stderr  # kineto's notices held back
    trace = traced / "profile" / "rank0.step3-4.pt.trace.json"
    assert sorted(p.name for p in (traced / "profile").iterdir()) == [trace.name]
    names = _range_names(trace)
    assert {"ember/step 3", "ember/step 4"} <= names and "ember/step 5" not in names and "ember/step 2" not in names
    assert {"ember/data_wait", "ember/forward", "ember/backward", "ember/optimizer", "ember/checkpoint"} <= names
    assert "profile of steps 3-4: matmul" in proc.stdout and "aten::mm" in proc.stdout
    # micro-batches of 2 (accumulated twice) against 4: the loss of a global batch is the same to rounding
    assert _losses(traced) == pytest.approx(_losses(plain), rel=1e-5)
    again = tmp_path / "again"
    assert run_ember("train", "debug", *TINY, "micro_batch_size=2", "metrics.console=false",
                     f"output_dir={again}").returncode == 0
    assert _losses(again) == _losses(traced)  # bit for bit: profiling changes nothing


@pytest.mark.slow
def test_every_rank_writes_its_trace_and_communication_is_counted(tmp_path: Path):
    run = tmp_path / "run"
    proc = run_ember("train", "--nproc-per-node", "2", "debug", *TINY, "micro_batch_size=2", "ici_mesh.fsdp=2",
                     "profile.enabled=true", "profile.step=2", "profile.steps=1", f"output_dir={run}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    for rank in (0, 1):
        assert "ember/step 2" in _range_names(run / "profile" / f"rank{rank}.step2-2.pt.trace.json")
    line = next(line for line in proc.stdout.splitlines() if line.startswith("profile of steps 2-2"))
    communication_ms = float(line.split("; communication ")[1].split(" ms")[0])
    exposed_ms = float(line.split("exposed ")[1].split(" ms")[0])
    assert communication_ms > 0 and 0 < exposed_ms <= communication_ms + 1e-6


def test_profile_keys_are_checked():
    from ember.config import ConfigError
    from ember.train import run as run_lib

    with pytest.raises(ConfigError, match="profile.step=0 and profile.steps=2 must be >= 1"):
        run_lib.load_config("debug", ["profile.step=0"])
    assert run_lib.load_config("debug", ["profile_step=7", "profile_duration=3"]).profile.__dict__ == \
        {"enabled": True, "step": 7, "steps": 3}
    with pytest.raises(ConfigError) as info:
        run_lib.load_config("debug", ["max_steps=20", "profile_step=21"])
    assert str(info.value) == ("profile.step=21 is past max_steps=20: no step would be traced; "
                               "choose profile.step in 1-20")
    assert run_lib.load_config("debug", ["max_steps=20", "profile.step=21"]).profile.step == 21  # profiling off: unused


def _planned(start_step: int, max_steps: int, first: int = 3, steps: int = 3) -> tuple[list[str], StepProfiler]:
    said: list[str] = []
    profiler = StepProfiler(True, first, steps, Path("unused"), 0, torch.device("cpu"), said.append)
    profiler.plan(start_step, max_steps)
    return said, profiler


def test_a_window_cut_by_max_steps_or_a_resume_is_said_before_the_first_step():
    said, profiler = _planned(0, 4)
    assert said == ["profile: tracing steps 3-4 only: steps 3-5 (profile.step=3, profile.steps=3) asked, but "
                    "max_steps=4 ends the run"]
    assert (profiler.enabled, profiler.first, profiler.last) == (True, 3, 4)
    said, profiler = _planned(3, 10)
    assert said == ["profile: tracing steps 4-5 only: steps 3-5 (profile.step=3, profile.steps=3) asked, but this "
                    "run resumes after step 3"] and (profiler.first, profiler.last) == (4, 5)
    said, profiler = _planned(8, 10)
    assert said == ["profile: nothing is traced: steps 3-5 (profile.step=3, profile.steps=3) asked, but this run "
                    "resumes after step 8; choose profile.step in 9-10"] and not profiler.enabled
    assert _planned(0, 5)[0] == [] and _planned(0, 10)[1].last == 5  # the whole window fits: nothing to say


def test_kinetos_notices_are_held_back_and_other_stderr_output_is_not(capfd: pytest.CaptureFixture):
    with without_kineto_notices():
        os.write(2, b"USDT:2026-11-25 13:10:02 7856:7856 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"STAGE:2026-11-25 13:10:09 8043:8043 SyncActivityProfilerHandler.cpp:51] "
                 b"Completed Stage: Warm Up\n")
        os.write(2, b"a real warning\n")
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "a real warning\nafter\n"
