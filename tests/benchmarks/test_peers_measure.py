"""benchmarks/peers.py's measure and judge: one round of a framework, from its command through its child process
to the figures read from its files. The peers are fakes that write the files litgpt's and torchtitan's runs
write (test_peers_frameworks.py says where their layout comes from); ember runs for real (slow)."""

import sys
from pathlib import Path

import pytest

from tests.helpers import load_benchmark

peers = load_benchmark("peers")
frameworks, rss = peers.frameworks, peers.rss
TINY = peers.SHAPES["tiny"]  # 2 x 64 = 128 tokens a step

# A peers' python that runs this script in place of the runner it is given: it records the runner's facts and
# one row (litgpt's CSV logger) or record (torchtitan's MetricsProcessor) per step, STEP_TIMES apart, then waits
# a little, as a framework does after its last step (so that the train RSS is taken).
FAKE_PEER = """\
import argparse, csv, json, sys, time
from pathlib import Path

runner = Path(sys.argv[1]).name
parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path)
parser.add_argument("--steps", type=int)
run, _ = parser.parse_known_args(sys.argv[2:])
run.out.mkdir(parents=True)
STEP_TIMES = [9.5, 0.5, 0.25, 0.125, 0.5, 0.375, 0.25][:run.steps]
with open(run.out / "peers.jsonl", "a") as facts:
    name = runner.split("_")[0]
    facts.write(json.dumps({"kind": "version", "value": f"{name} 1.2.3"}) + "\\n")
    facts.write(json.dumps({"kind": "params", "value": 164160}) + "\\n")
print("training", flush=True)
if runner == "litgpt_run.py":
    logs = run.out / "logs" / "csv" / "version_0"
    logs.mkdir(parents=True)
    rows = [{"loss": 6.4, "iter": i + 1, "step": i, "iter_time": t} for i, t in enumerate(STEP_TIMES)]
    with open(logs / "metrics.csv", "w", newline="") as sink:
        writer = csv.DictWriter(sink, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
else:
    with open(run.out / "metrics.jsonl", "w") as sink:
        for i, t in enumerate(STEP_TIMES):
            sink.write(json.dumps({"step": i + 1, "time_metrics/end_to_end(s)": t, "throughput(tps)": 128 / t}) + "\\n")
time.sleep(0.3)
print("done", flush=True)
"""


@pytest.fixture
def fake_peers_python(tmp_path: Path) -> Path:
    script = tmp_path / "fake_peer.py"
    script.write_text(FAKE_PEER)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    python.chmod(0o755)
    return python


def _args(*argv: str):
    return peers.parse_args(["--shapes", "tiny", "--rounds", "1", "--out", "/nowhere", *argv])


@pytest.mark.parametrize("framework", ["litgpt", "torchtitan"])
def test_a_peers_round_is_read_from_the_files_its_run_wrote(framework, fake_peers_python):
    args = _args("--steps", "7", "--warmup", "1", "--warmup-compiled", "2")
    result = peers.measure(framework, "tiny", "fp32", "compiled", args, fake_peers_python)
    kept = [0.25, 0.125, 0.5, 0.375, 0.25]  # after the 2 warmup steps of a compiled run
    assert result["status"] == "ok"
    assert result["step_times_s"] == [9.5, 0.5, *kept]
    assert (result["params"], result["versions"], result["patches"]) == (164_160, [f"{framework} 1.2.3"], [])
    assert result["step_s"] == 0.25 and result["tokens_per_s"] == 512.0 and result["step_spread"] == 4.0
    assert result["noisy"] is True
    assert result["warning"] == (f"{framework}'s kept step times vary 4.0x (125-500 ms): raise --steps/--warmup, or "
                                 "idle the machine")
    # the child's own memory: a python interpreter's, some MiB; the train RSS taken once all but one step showed
    assert 1024 < result["train_rss_kib"] <= result["peak_rss_kib"] < 1024 * 1024


def test_a_peer_that_logs_too_few_steps_fails_its_round_with_the_reason(fake_peers_python, capsys):
    args = _args("--steps", "3", "--warmup", "1", "--modes", "eager")
    args.warmup = 3  # more than the run logs: the command line refuses it, a framework that logs fewer does not
    result = peers.measure("torchtitan", "tiny", "fp32", "eager", args, fake_peers_python)
    assert result["status"] == "failed"
    assert result["reason"] == "3 step times in its metrics files, not more than the 3 warmup: done"
    assert "torchtitan failed (3 step times in its metrics files" in capsys.readouterr().err


def _child(code: int = 0, output: str = "", train_kib=1024) -> "rss.ChildRun":
    return rss.ChildRun(code=code, peak_kib=2048, output=output, train_kib=train_kib)


def _measured(times, params=164_160) -> "frameworks.Measured":
    return frameworks.Measured(times, params, ["a patch"], ["torchtitan 0.3.0"])


def test_a_round_is_the_median_of_the_steps_after_warmup():
    result = peers.judge("ember", TINY, _measured([21.3, 1.06, 0.58, 0.11, 1.05, 1.04]), _child(), 2, 1800)
    assert result == {"params": 164_160, "peak_rss_kib": 2048, "train_rss_kib": 1024,
                      "step_times_s": [21.3, 1.06, 0.58, 0.11, 1.05, 1.04], "patches": ["a patch"],
                      "versions": ["torchtitan 0.3.0"], "status": "ok", "step_s": pytest.approx(0.81),
                      "tokens_per_s": pytest.approx(128 / 0.81), "step_spread": pytest.approx(1.05 / 0.11),
                      "noisy": True, "warning": "ember's kept step times vary 9.5x (110-1050 ms): raise "
                                                "--steps/--warmup, or idle the machine"}
    steady = peers.judge("ember", TINY, _measured([2.0, 0.5, 0.55, 0.6]), _child(), 1, 1800)
    assert (steady["step_s"], steady["tokens_per_s"], steady["noisy"], steady["warning"]) == (0.55, 128 / 0.55,
                                                                                              False, None)


@pytest.mark.parametrize("child, measured, unreadable, reason", [
    (_child(-9, "step 3\n", None), _measured([1.0] * 3), None,
     "killed (SIGKILL: the 1800 s --timeout, or out of memory): step 3"),
    (_child(1, "Traceback (most recent call last):\nImportError: no litgpt\n"), _measured([]), None,
     "exit code 1: ImportError: no litgpt"),
    (_child(0, ""), _measured([]), "JSONDecodeError: Expecting value: line 1 column 1 (char 0)",
     "unreadable metrics files (JSONDecodeError: Expecting value: line 1 column 1 (char 0)), no output"),
    (_child(0, "done\n"), _measured([1.0, 1.0]), None,
     "2 step times in its metrics files, not more than the 2 warmup: done"),
    (_child(0, "done\n"), _measured([1.0] * 6, params=None), None, "no parameter count in its files: done"),
], ids=["killed", "exit-code", "unreadable", "too-few-steps", "no-params"])
def test_a_failed_round_says_why_with_the_last_line_of_its_output(child, measured, unreadable, reason):
    result = peers.judge("litgpt", TINY, measured, child, 2, 1800, unreadable)
    assert (result["status"], result["reason"]) == ("failed", reason)
    assert (result["peak_rss_kib"], result["step_times_s"]) == (2048, measured.step_times_s)


@pytest.mark.slow
def test_ember_trains_the_tiny_shape_and_its_round_is_read_from_its_files():
    args = _args("--steps", "4", "--warmup", "1", "--modes", "eager", "--frameworks", "ember")
    result = peers.measure("ember", "tiny", "fp32", "eager", args, None)
    assert result["status"] == "ok", result.get("reason")
    # the count litgpt's and torchtitan's runs of the tiny shape printed: the same model
    assert result["params"] == 164_160
    assert len(result["step_times_s"]) == 4 and all(t > 0 for t in result["step_times_s"])
    assert result["tokens_per_s"] == pytest.approx(128 / sorted(result["step_times_s"][1:])[1])
    assert 0 < result["train_rss_kib"] <= result["peak_rss_kib"]
