"""benchmarks/peers.py's reading of each framework's own output (lines captured from real runs of the tiny shape
on this repository's CPU), its checks (equal parameter counts, steps left after warmup), the bf16 skip and the
missing-environment error. Nothing here starts a framework: the peers' environment is not needed."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest

from ember.errors import ConfigError
from tests.helpers import load_benchmark

peers = load_benchmark("peers")


@pytest.fixture(autouse=True)
def _keep_the_sigterm_handler():
    """peers.main installs its SIGTERM handler in this process: pytest's own is put back after each test."""
    handler = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, handler)

# `ember train debug ... logging_steps=1`'s metrics.jsonl: one record per step, then the final validation's.
EMBER_METRICS = """\
{"step": 1, "loss": 6.630095481872559, "loss_avg": 6.630095481872559, "lr": 0.002, "grad_norm": 0.7299246788024902, "tokens_per_s": 7874.442506116272, "tokens_per_s_per_device": 7874.442506116272, "step_time_s": 0.016255119000561535, "tflops_per_device": 0.00698192169470303, "mfu": 0.05348246533000974, "memory_gb": 0.3253517150878906, "tokens_seen": 128, "data_wait_frac": 0.14244608153371519}
{"step": 2, "loss": 6.658548831939697, "loss_avg": 6.658548831939697, "lr": 0.002, "grad_norm": 0.7266488075256348, "tokens_per_s": 14443.85026664115, "tokens_per_s_per_device": 14443.85026664115, "step_time_s": 0.00886190299934242, "tflops_per_device": 0.012806726502018974, "mfu": 0.09810125866275271, "memory_gb": 0.3268165588378906, "tokens_seen": 256, "data_wait_frac": 0.010321823232995181}
{"step": 3, "loss": 6.643980026245117, "loss_avg": 6.643980026245117, "lr": 0.002, "grad_norm": 0.730373203754425, "tokens_per_s": 16877.456868083143, "tokens_per_s_per_device": 16877.456868083143, "step_time_s": 0.0075840810022782534, "tflops_per_device": 0.014964498396827128, "mfu": 0.11463008347637088, "memory_gb": 0.3269386291503906, "tokens_seen": 384, "data_wait_frac": 0.012881191301306431}
{"step": 3, "val_loss": 6.693024635314941}
"""

# litgpt pretrain.py's output (fabric.print), from its parameter count to its per-iteration lines.
LITGPT_LOG = """\
Seed set to 0
Time to instantiate model: 0.01 seconds.
Total parameters: 164,160
Verifying settings ...
Measured TFLOPs: 0.00
Epoch 1 | iter 1 step 1 | loss train: 6.390, val: n/a | iter time: 21295.49 ms (step) remaining time: 0:01:46
Epoch 1 | iter 2 step 2 | loss train: 6.377, val: n/a | iter time: 1058.10 ms (step) remaining time: 0:00:44
Epoch 1 | iter 3 step 3 | loss train: 6.476, val: n/a | iter time: 579.80 ms (step) remaining time: 0:00:22
Saving checkpoint to '/tmp/lit/final/lit_model.pth'
"""

# torchtitan's logger: the model size line, then one metrics line per step (log_freq=1).
TITAN_LOG = """\
[titan] 2026-11-26 18:29:02,367 - root - INFO - Model llama3 debugmodel size: 164,160 total parameters
[titan] 2026-11-26 18:29:03,836 - root - INFO - step:  1  loss:  6.64856  grad_norm:  0.7329  memory: -0.00GiB(-0.00%)  tps: 87  tflops: 0.00  mfu: 0.00%
[titan] 2026-11-26 18:29:03,836 - root - INFO - Synchronizing and adjusting timeout for all ProcessGroups to 0:01:40
[titan] 2026-11-26 18:29:05,108 - root - INFO - step:  2  loss:  6.80090  grad_norm:  0.7333  memory: -0.00GiB(-0.00%)  tps: 101  tflops: 0.00  mfu: 0.00%
"""

# the debug shape's (batch 8 x 256): tps over a thousand is printed with a thousands separator
TITAN_DEBUG_LOG = """\
[titan] 2026-11-26 18:40:09,316 - root - INFO - Model llama3 debugmodel size: 7,145,728 total parameters
[titan] 2026-11-26 18:40:10,426 - root - INFO - step:  1  loss:  9.48473  grad_norm:  0.3656  memory: -0.00GiB(-0.00%)  tps: 1,845  tflops: 0.06  mfu: 0.02%
[titan] 2026-11-26 18:40:11,063 - root - INFO - step:  2  loss:  9.44852  grad_norm:  0.3638  memory: -0.00GiB(-0.00%)  tps: 3,214  tflops: 0.11  mfu: 0.03%
"""


def test_ember_step_times_come_from_its_training_records():
    assert peers.parse_ember_metrics(EMBER_METRICS) == [0.016255119000561535, 0.00886190299934242,
                                                        0.0075840810022782534]


def test_litgpt_iter_times_and_parameter_count():
    times, params = peers.parse_litgpt_log(LITGPT_LOG)
    assert times == pytest.approx([21.29549, 1.0581, 0.5798], rel=1e-12)
    assert params == 164_160


def test_torchtitan_step_times_are_tokens_over_its_logged_tps():
    times, params = peers.parse_torchtitan_log(TITAN_LOG, tokens_per_step=2 * 64)
    assert times == [128 / 87, 128 / 101]
    assert params == 164_160
    assert peers.parse_torchtitan_log(TITAN_DEBUG_LOG, tokens_per_step=8 * 256) == ([2048 / 1845, 2048 / 3214],
                                                                                     7_145_728)


def test_steady_state_drops_the_warmup_steps():
    times = [21.3, 1.06, 0.58, 0.11, 1.05, 1.04]
    assert peers.steady_step_time(times, warmup=2) == pytest.approx((0.58 + 1.04) / 2)
    assert peers.steady_step_time(times, warmup=5) == 1.04
    with pytest.raises(ValueError, match="6 step times, none left after dropping 6 warmup steps"):
        peers.steady_step_time(times, warmup=6)


def test_unequal_parameter_counts_are_refused():
    peers.check_param_counts("debug", {"ember": 6_030_592, "litgpt": 6_030_592, "torchtitan": 6_030_592})
    with pytest.raises(ConfigError, match="shape debug: ember builds 6,030,592 parameters but torchtitan "
                                          "6,031,104: not the same model"):
        peers.check_param_counts("debug", {"ember": 6_030_592, "litgpt": 6_030_592, "torchtitan": 6_031_104})


def test_bf16_is_skipped_only_on_a_cpu_without_bf16_instructions():
    reason = peers.bf16_skip_reason("cpu", force=False, native=False)
    assert reason.startswith("this CPU has no bf16 matmul instructions") and "--force-bf16" in reason
    assert peers.bf16_skip_reason("cpu", force=True, native=False) is None
    assert peers.bf16_skip_reason("cpu", force=False, native=True) is None
    assert peers.bf16_skip_reason("cuda", force=False, native=False) is None


def test_skipped_rows_are_in_the_table_with_their_reason(capsys):
    reason = peers.bf16_skip_reason("cpu", force=False, native=False)
    peers.print_table([peers.not_run("debug", "bf16", "eager", "ember", "skipped", reason),
                       peers.not_run("debug", "fp32", "eager", "litgpt", "n/a", peers.LITGPT_EAGER)])
    out = capsys.readouterr().out
    assert f"debug  bf16      eager     ember       skipped: {reason}" in out
    assert "debug  fp32      eager     litgpt      n/a: n/a (litgpt pretrain always compiles)" in out


def test_eager_ember_meets_each_peer_in_its_default_mode_compiled_meets_compiled():
    rows = [{"shape": "debug", "precision": "fp32", "mode": mode, "framework": framework, "tokens_per_s": tps,
             "train_rss_mib": rss, "noisy": False, "step_spread": 1.1}
            for mode, framework, tps, rss in [("eager", "ember", 4000.0, 700.0), ("eager", "torchtitan", 3000.0, 900.0),
                                              ("eager", "litgpt", None, None), ("compiled", "ember", 6000.0, 800.0),
                                              ("compiled", "litgpt", 5000.0, 1000.0),
                                              ("compiled", "torchtitan", 4500.0, None)]]
    assert peers.summary_lines(rows) == [
        "debug fp32 eager: ember 4,000 tok/s vs fastest peer litgpt (compiled) 5,000 tok/s: 0.80x",
        "debug fp32 eager: training RSS ember 700 MiB vs lowest peer torchtitan 900 MiB: 0.78x",
        "debug fp32 compiled: ember 6,000 tok/s vs fastest peer litgpt (compiled) 5,000 tok/s: 1.20x",
        "debug fp32 compiled: training RSS ember 800 MiB vs lowest peer litgpt 1,000 MiB: 0.80x"]


def test_a_missing_peers_environment_names_the_setup_commands(tmp_path):
    with pytest.raises(ConfigError) as raised:
        peers.find_peers_python(None, {}, repo=tmp_path)
    assert str(raised.value) == (
        f"no peers environment: {tmp_path}/.venv-peers/bin/python does not exist; set one up with `python -m venv "
        ".venv-peers && .venv-peers/bin/pip install torch==2.13.0 && .venv-peers/bin/pip install torch==2.13.0 -r "
        "benchmarks/requirements-peers.txt` (or point --peers-python or EMBER_PEERS_PYTHON at a python that has "
        "litgpt and torchtitan)")
    python = tmp_path / "python"
    python.touch()
    assert peers.find_peers_python(None, {"EMBER_PEERS_PYTHON": str(python)}, repo=tmp_path) == python
    assert peers.find_peers_python(str(python), {"EMBER_PEERS_PYTHON": "/nowhere"}, repo=tmp_path) == python


def test_the_peers_are_given_embers_ffn_width_and_recipe_settings():
    args = peers.parse_args(["--shapes", "debug", "--modes", "eager"])
    cmd = peers.command("torchtitan", peers.SHAPES["debug"], "fp32", "eager", args, Path("/out"), Path("/py"))
    flag = lambda name: cmd[cmd.index(name) + 1]  # noqa: E731
    assert (flag("--ffn-hidden"), flag("--rope-theta"), flag("--lr"), flag("--weight-decay")) == (
        "704", "500000.0", "0.002", "0.1")
    assert cmd[cmd.index("--betas") + 1:cmd.index("--betas") + 3] == ["0.9", "0.95"]


@pytest.mark.parametrize("flag, value", [("--rounds", "0"), ("--timeout", "0"), ("--warmup", "-2")])
def test_counts_and_the_timeout_are_refused_when_they_leave_nothing_to_measure(flag, value):
    with pytest.raises(ConfigError, match=f"{flag} {value}: must be"):
        peers.parse_args([flag, value])


def test_an_out_that_is_a_file_is_refused_before_any_work(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="a file, not a folder"):
        peers.parse_args(["--out", str(tmp_path / "f")])


def test_steps_must_outlast_the_warmup():
    with pytest.raises(ConfigError, match="--steps 5 leaves no step after the 5 warmup steps"):
        peers.parse_args(["--steps", "5"])


@pytest.mark.parametrize("argv, message", [
    (["--steps", "3", "--warmup", "2"], "--steps 3 leaves no step after the 4 warmup steps of --warmup-compiled (its "
                                        "default: --warmup + 2): raise --steps, lower --warmup-compiled, or run "
                                        "--modes eager"),
    (["--steps", "3", "--warmup", "1", "--warmup-compiled", "3"],
     "--steps 3 leaves no step after the 3 warmup steps of --warmup-compiled: raise --steps, lower "
     "--warmup-compiled, or run --modes eager"),
    (["--steps", "3", "--warmup", "3", "--modes", "eager"],
     "--steps 3 leaves no step after the 3 warmup steps of --warmup: raise --steps, or lower --warmup"),
    (["--steps", "3", "--warmup", "3", "--warmup-compiled", "1"],
     "--steps 3 leaves no step after the 3 warmup steps of --warmup: raise --steps, lower --warmup, or run "
     "--modes compiled")])
def test_too_few_steps_name_the_warmup_option_that_takes_them_and_the_ways_out(argv, message):
    with pytest.raises(ConfigError) as raised:
        peers.parse_args(argv)
    assert str(raised.value) == message


def test_only_the_modes_that_run_drop_warmup_steps():
    # compiled alone: --warmup (an eager run's) takes nothing from it
    args = peers.parse_args(["--modes", "compiled", "--steps", "6", "--warmup", "8", "--warmup-compiled", "2"])
    assert (args.steps, args.warmup_compiled) == (6, 2)


@pytest.mark.slow
def test_a_childs_peak_rss_is_its_own_and_a_hung_child_is_killed(tmp_path):
    touch_300_mib = "import time; data = b'x' * (300 * 2**20); print('done'); time.sleep(0.5); raise SystemExit(3)"
    code, rss_kib, output, _ = peers.run_child([sys.executable, "-c", touch_300_mib], tmp_path / "a.log", timeout_s=60)
    assert (code, output) == (3, "done\n")
    assert 300 * 1024 <= rss_kib < 400 * 1024  # the child's own peak, in KiB
    # A launcher with a larger peak than the child's: wait4 would report the launcher's, the child's is kept.
    ballast = bytearray(os.urandom(1)) * (700 * 2**20)
    code, rss_kib, _, _ = peers.run_child([sys.executable, "-c", touch_300_mib], tmp_path / "a2.log", timeout_s=60)
    assert code == 3 and 300 * 1024 <= rss_kib < 400 * 1024 and len(ballast) == 700 * 2**20
    del ballast
    # The peak up to a point the output marks (the training steps), not what the process does after it.
    script = ("import sys, time; print('step', flush=True); time.sleep(1); data = b'x' * (300 * 2**20); "
              "print('step', flush=True)")
    code, rss_kib, output, train_kib = peers.run_child([sys.executable, "-c", script], tmp_path / "c.log", 60,
                                                      lambda text: text.count("step"), 1)
    assert code == 0 and train_kib < 100 * 1024 and rss_kib >= 300 * 1024
    code, _, _, _ = peers.run_child([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "b.log", 1)
    assert code == -9


def test_the_out_option_says_what_it_is(capsys):
    with pytest.raises(SystemExit):
        peers.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert ("--out OUT the folder the results file peers-<device>.json is written to (default: benchmarks/results, "
            "beside this script); created if missing") in help_text


def _fake_measure(interrupt_at: int = 0, warn: bool = False, noisy: tuple[str, ...] = (), spread: float = 1.6,
                  signum: int = signal.SIGINT):
    """peers.measure without a child: every run ok at 1,000 tok/s; the `interrupt_at`-th call (1-based) is a
    Ctrl-C (`signum` SIGTERM: that signal, raised in this process). The frameworks in `noisy` (every one with
    `warn`) have kept step times `spread` apart and warn of it; the others' spread is 1.1x. torchtitan's runs
    print their version, as its runner does."""
    calls = []

    def measure(framework, shape, precision, mode, args, peers_python):
        calls.append(framework)
        if len(calls) == interrupt_at and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if len(calls) == interrupt_at:
            signal.raise_signal(signum)
        is_noisy = warn or framework in noisy
        warning = (f"{framework}'s kept step times vary {spread:.1f}x (10-16 ms): raise --steps/--warmup"
                   if is_noisy else None)
        return {"params": 1000, "peak_rss_kib": 2048, "train_rss_kib": 1024, "step_times_s": [0.01] * 6,
                "patches": [], "versions": ["torchtitan 0.3.0"] if framework == "torchtitan" else [],
                "status": "ok", "step_s": 0.128, "tokens_per_s": 1000.0, "step_spread": spread if is_noisy else 1.1,
                "noisy": is_noisy, "warning": warning}

    return measure


def _main(tmp_path: Path, monkeypatch, measure, *argv: str) -> int:
    """peers.main on two tiny shapes, eager fp32, one round, its peers' python a script that prints 0.5.13."""
    python = tmp_path / "peers-python"
    python.write_text("#!/bin/sh\necho 0.5.13\n")
    python.chmod(0o755)
    monkeypatch.setattr(peers, "measure", measure)
    return peers.main(["--shapes", "tiny,debug", "--precisions", "fp32", "--modes", "eager", "--rounds", "1",
                       "--steps", "6", "--warmup", "2", "--peers-python", str(python), "--out", str(tmp_path / "out"),
                       *argv])


def test_the_summary_heading_names_only_the_peers_that_ran(tmp_path, monkeypatch, capsys):
    assert _main(tmp_path, monkeypatch, _fake_measure(), "--frameworks", "ember,torchtitan") == 0
    out = capsys.readouterr().out
    assert "\nember vs fastest peer (eager ember against torchtitan eager, its default):\n" in out
    assert "litgpt" not in out
    rows = [{"shape": "debug", "precision": "fp32", "mode": mode, "framework": framework, "tokens_per_s": 1.0}
            for mode, framework in [("eager", "ember"), ("compiled", "litgpt"), ("eager", "torchtitan")]]
    assert peers.summary_heading(rows) == ("ember vs fastest peer (eager ember against litgpt compiled and torchtitan "
                                           "eager, their defaults):")
    assert peers.summary_heading(rows[:1]) == "ember vs fastest peer:"


def test_the_summary_heading_names_only_the_modes_that_ran(tmp_path, monkeypatch, capsys):
    assert _main(tmp_path, monkeypatch, _fake_measure(), "--frameworks", "ember,torchtitan", "--modes", "compiled") == 0
    heading = capsys.readouterr().out.split("\n\nember vs fastest peer")[1].splitlines()[0]
    assert heading == " (compiled ember against compiled torchtitan):"
    rows = [{"shape": "debug", "precision": "fp32", "mode": mode, "framework": framework, "tokens_per_s": 1.0}
            for mode in ("eager", "compiled") for framework in ("ember", "litgpt", "torchtitan")]
    assert peers.summary_heading(rows) == ("ember vs fastest peer (eager ember against litgpt compiled and torchtitan "
                                           "eager, their defaults; compiled ember against compiled litgpt and "
                                           "torchtitan):")


def test_a_noisy_row_is_marked_in_the_results_the_table_and_the_summary(tmp_path, monkeypatch, capsys):
    measure = _fake_measure(noisy=("torchtitan",), spread=5.9)
    assert _main(tmp_path, monkeypatch, measure, "--frameworks", "ember,torchtitan", "--shapes", "tiny") == 0
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "out" / "peers-cpu.json").read_text())
    assert [(r["framework"], r["noisy"], r["step_spread"]) for r in result["rows"]] == [("ember", False, 1.1),
                                                                                       ("torchtitan", True, 5.9)]
    assert "tiny   fp32      eager     torchtitan" in out
    table_row = next(line for line in out.splitlines() if line.startswith("tiny   fp32      eager     torchtitan"))
    assert table_row.endswith("1.00x  (noisy: step times vary 5.9x)")
    assert ("  tiny fp32 eager: ember 1,000 tok/s vs fastest peer torchtitan (eager) 1,000 tok/s: 1.00x (noisy: "
            "torchtitan step times vary 5.9x)\n") in out
    assert result["summary"].startswith("tiny fp32 eager: ember 1,000 tok/s vs fastest peer torchtitan (eager) "
                                        "1,000 tok/s: 1.00x (noisy: torchtitan step times vary 5.9x)")


@pytest.mark.parametrize("signum, code, how", [(signal.SIGINT, 130, "interrupted"),
                                               (signal.SIGTERM, 143, "stopped by SIGTERM")], ids=["ctrl-c", "sigterm"])
def test_a_ctrl_c_or_a_sigterm_writes_the_finished_rows_marked_interrupted(tmp_path, monkeypatch, capsys, signum,
                                                                           code, how):
    # ember and torchtitan finish the tiny shape; the third run (the debug shape's first) is stopped, as by
    # Ctrl-C or `timeout -s TERM`
    assert _main(tmp_path, monkeypatch, _fake_measure(interrupt_at=3, signum=signum), "--frameworks",
                 "ember,torchtitan") == code
    path = tmp_path / "out" / "peers-cpu.json"
    result = json.loads(path.read_text())
    assert result["interrupted"] is True
    assert [(r["shape"], r["framework"], r["status"]) for r in result["rows"]] == [("tiny", "ember", "ok"),
                                                                                  ("tiny", "torchtitan", "ok")]
    assert capsys.readouterr().err == (f'peers.py: {how}; the 2 rows that finished are in {path} (marked '
                                       '"interrupted": true)\n')


def test_a_sigterm_kills_the_running_child_and_what_it_started(tmp_path):
    signal.signal(signal.SIGTERM, peers._stop)
    started = "sleep 60 & echo $! $$; wait"  # a grandchild, as a compile worker is
    pids: list[int] = []

    def steps_done(text: str) -> int:  # the signal arrives while run_child polls, once both pids are printed
        if text.strip() and not pids:
            pids.extend(int(pid) for pid in text.split())
            signal.raise_signal(signal.SIGTERM)
        return 0

    with pytest.raises(peers.Stopped):
        peers.run_child(["sh", "-c", started], tmp_path / "a.log", 60, steps_done, 1)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(pids) == 2 and not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting to be reaped does not)."""
    try:
        return " Z " not in Path(f"/proc/{pid}/stat").read_text().split(")", 1)[1][:3]
    except OSError:
        return False


def test_the_interrupted_message_counts_only_measured_rows(tmp_path, monkeypatch, capsys):
    # litgpt's eager rows are n/a placeholders: in the file, not counted as finished
    code = _main(tmp_path, monkeypatch, _fake_measure(interrupt_at=3), "--frameworks", "ember,litgpt,torchtitan")
    path = tmp_path / "out" / "peers-cpu.json"
    assert code == 130
    assert [r["status"] for r in json.loads(path.read_text())["rows"]] == ["n/a", "ok", "ok"]
    assert capsys.readouterr().err == (f'peers.py: interrupted; the 2 rows that finished are in {path} (marked '
                                       '"interrupted": true)\n')
    code = _main(tmp_path, monkeypatch, _fake_measure(interrupt_at=2), "--frameworks", "ember,litgpt")
    assert code == 130
    assert capsys.readouterr().err == (f'peers.py: interrupted; the row that finished is in {path} (marked '
                                       '"interrupted": true)\n')


def test_a_ctrl_c_before_any_row_finished_writes_nothing(tmp_path, monkeypatch, capsys):
    code = _main(tmp_path, monkeypatch, _fake_measure(interrupt_at=2), "--frameworks", "ember,torchtitan")
    assert code == 130 and not (tmp_path / "out").exists()
    assert capsys.readouterr().err == "peers.py: interrupted before any row finished; no results written\n"


def test_the_results_keep_every_peers_version_and_the_printed_warnings(tmp_path, monkeypatch, capsys):
    # eager only: litgpt runs nowhere (its pretraining always compiles), so its version comes from its environment
    assert _main(tmp_path, monkeypatch, _fake_measure(warn=True)) == 0
    result = json.loads((tmp_path / "out" / "peers-cpu.json").read_text())
    assert (result["litgpt"], result["torchtitan"]) == ("0.5.13", "0.3.0")
    assert "interrupted" not in result
    warning = "kept step times vary 1.6x (10-16 ms): raise --steps/--warmup"
    assert result["warnings"].split("; ") == [f"{shape} fp32 eager round 1: {framework}'s {warning}"
                                              for shape in ("tiny", "debug") for framework in ("ember", "torchtitan")]


def test_the_results_record_embers_version_and_commit(tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "git_commit", lambda repo: f"0123abc-dirty {repo}")
    assert _main(tmp_path, monkeypatch, _fake_measure(), "--frameworks", "ember") == 0
    result = json.loads((tmp_path / "out" / "peers-cpu.json").read_text())
    assert (result["ember"], result["ember_commit"]) == (version("ember"), f"0123abc-dirty {peers.REPO}")


def test_the_commit_is_heads_marked_dirty_by_any_change_and_none_without_git(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    (repo / "a.py").write_text("a = 1\n")
    subprocess.run(git + ["add", "a.py"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "a"], check=True)
    head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert peers.git_commit(repo) == head
    (repo / "b.py").write_text("b = 1\n")  # untracked: the code that runs is not the commit's alone
    assert peers.git_commit(repo) == f"{head}-dirty"
    not_a_checkout = tmp_path / "plain"
    not_a_checkout.mkdir()
    assert peers.git_commit(not_a_checkout) is None
    monkeypatch.setenv("PATH", str(not_a_checkout))  # no git to run
    assert peers.git_commit(repo) is None


def test_every_option_says_its_default_and_choices(capsys):
    with pytest.raises(SystemExit):
        peers.parse_args(["--help"])
    options = capsys.readouterr().out.split("\noptions:\n")[1]
    blocks = [" ".join(block.split()) for block in re.split(r"\n(?=  -)", options) if "--help" not in block]
    assert len(blocks) == 13 and all("(default: " in block for block in blocks), blocks
    assert "--precisions PRECISIONS comma-separated, of fp32, bf16 (default: fp32,bf16;" in blocks[1]
    assert blocks[8] == "--device {cpu,cuda} where every framework trains, cpu or cuda (default: cpu)"
    # the string defaults still arrive as lists
    args = peers.parse_args([])
    assert (args.shapes, args.precisions, args.modes, args.frameworks) == (
        ["debug", "56m", "128k"], ["fp32", "bf16"], ["eager", "compiled"], ["ember", "litgpt", "torchtitan"])
