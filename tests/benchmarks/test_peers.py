"""benchmarks/peers.py's rows and its results file: a framework's rounds summed up, the table, the summary of
ember against the fastest peer, the versions and warnings kept, Ctrl-C and SIGTERM. main runs with measure
replaced (no child starts); the results file's keys are checked against the committed one, which
docs/performance.md renders."""

import json
import signal
from importlib.metadata import version
from pathlib import Path

import pytest

from tests.helpers import BENCHMARKS, load_benchmark

peers = load_benchmark("peers")
render = load_benchmark("render_performance")


def test_skipped_rows_are_in_the_table_with_their_reason(capsys):
    reason = peers.bf16_skip_reason("cpu", force=False, native=False)
    peers.table.print_table([peers.table.not_run("debug", "bf16", "eager", "ember", "skipped", reason),
                             peers.table.not_run("debug", "fp32", "eager", "litgpt", "n/a",
                                                 peers.frameworks.LITGPT_EAGER)])
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
    assert peers.table.summary_lines(rows) == [
        "debug fp32 eager: ember 4,000 tok/s vs fastest peer litgpt (compiled) 5,000 tok/s: 0.80x",
        "debug fp32 eager: training RSS ember 700 MiB vs lowest peer torchtitan 900 MiB: 0.78x",
        "debug fp32 compiled: ember 6,000 tok/s vs fastest peer litgpt (compiled) 5,000 tok/s: 1.20x",
        "debug fp32 compiled: training RSS ember 800 MiB vs lowest peer litgpt 1,000 MiB: 0.80x"]


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
                "patches": ["device cpu"] if framework == "torchtitan" else [],
                "versions": ["torchtitan 0.3.0"] if framework == "torchtitan" else [],
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
    assert peers.table.summary_heading(rows) == ("ember vs fastest peer (eager ember against litgpt compiled and "
                                                 "torchtitan eager, their defaults):")
    assert peers.table.summary_heading(rows[:1]) == "ember vs fastest peer:"


def test_the_summary_heading_names_only_the_modes_that_ran(tmp_path, monkeypatch, capsys):
    assert _main(tmp_path, monkeypatch, _fake_measure(), "--frameworks", "ember,torchtitan", "--modes", "compiled") == 0
    heading = capsys.readouterr().out.split("\n\nember vs fastest peer")[1].splitlines()[0]
    assert heading == " (compiled ember against compiled torchtitan):"
    rows = [{"shape": "debug", "precision": "fp32", "mode": mode, "framework": framework, "tokens_per_s": 1.0}
            for mode in ("eager", "compiled") for framework in ("ember", "litgpt", "torchtitan")]
    assert peers.table.summary_heading(rows) == ("ember vs fastest peer (eager ember against litgpt compiled and "
                                                 "torchtitan eager, their defaults; compiled ember against compiled "
                                                 "litgpt and torchtitan):")


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
    monkeypatch.setattr(peers.env, "git_commit", lambda repo: f"0123abc-dirty {repo}")
    assert _main(tmp_path, monkeypatch, _fake_measure(), "--frameworks", "ember") == 0
    result = json.loads((tmp_path / "out" / "peers-cpu.json").read_text())
    assert (result["ember"], result["ember_commit"]) == (version("ember"), f"0123abc-dirty {peers.REPO}")


def test_a_row_is_the_median_of_the_rounds_that_ran_and_keeps_every_rounds_times():
    rounds = [{"status": "ok", "params": 164_160, "tokens_per_s": 1000.0, "peak_rss_kib": 4096, "train_rss_kib": 2048,
               "step_times_s": [0.2, 0.128], "noisy": False, "step_spread": 1.1},
              {"status": "ok", "params": 164_160, "tokens_per_s": 1280.0, "peak_rss_kib": 6144, "train_rss_kib": None,
               "step_times_s": [0.2, 0.1], "noisy": True, "step_spread": 1.7},
              {"status": "failed", "params": None, "reason": "exit code 1: boom", "peak_rss_kib": 512,
               "train_rss_kib": None, "step_times_s": []}]
    row = peers.table.summarize("tiny", "fp32", "eager", "torchtitan", rounds)
    assert {k: v for k, v in row.items() if k != "rounds"} == {
        "shape": "tiny", "precision": "fp32", "mode": "eager", "framework": "torchtitan", "status": "ok",
        "tokens_per_s": 1140.0, "step_ms": 128 / 1140.0 * 1e3, "train_rss_mib": 2.0, "peak_rss_mib": 5.0,
        "ember_ratio": None, "noisy": True, "step_spread": 1.7, "params": 164_160,
        "reason": "round 3: exit code 1: boom"}
    assert row["rounds"][2] == {"status": "failed", "tokens_per_s": None, "train_rss_kib": None, "peak_rss_kib": 512,
                                "step_times_s": []}
    failed = peers.table.summarize("tiny", "fp32", "eager", "ember", rounds[2:])
    assert (failed["status"], failed["tokens_per_s"], failed["params"]) == ("failed", None, None)


def test_each_peer_row_has_embers_tokens_over_its_own():
    rows = [{"shape": "debug", "precision": "fp32", "mode": "eager", "framework": f, "tokens_per_s": tps,
             "ember_ratio": None} for f, tps in [("ember", 4000.0), ("torchtitan", 3200.0), ("litgpt", None)]]
    peers.table.add_ember_ratios(rows)
    assert [r["ember_ratio"] for r in rows] == [None, 1.25, None]


def test_the_results_file_keeps_the_committed_files_keys_and_renders_alike(tmp_path, monkeypatch):
    assert _main(tmp_path, monkeypatch, _fake_measure(warn=True), "--shapes", "tiny") == 0
    path = tmp_path / "out" / "peers-cpu.json"
    result = json.loads(path.read_text())
    committed = json.loads((BENCHMARKS / "results" / "peers-cpu.json").read_text())
    # the committed file predates the ember/ember_commit/warnings keys and the rows' noisy/step_spread
    assert set(committed) <= set(result) and set(result) - set(committed) == {"ember", "ember_commit", "warnings"}
    assert set(result["config"]) == set(committed["config"])
    assert (result["torchtitan_patches"], result["notes"]) == ("device cpu", peers.NOTES)
    measured = next(r for r in committed["rows"] if r["status"] == "ok")
    assert set(result["rows"][1]) == set(measured) | {"noisy", "step_spread"}
    assert set(result["rows"][1]["rounds"][0]) == set(measured["rounds"][0])
    assert [(r["framework"], r["status"], r["tokens_per_s"], r["ember_ratio"]) for r in result["rows"]] == [
        ("litgpt", "n/a", None, None), ("ember", "ok", 1000.0, None), ("torchtitan", "ok", 1000.0, 1.0)]
    section = "\n".join(render.section(path))
    assert "torchtitan 0.3.0, litgpt 0.5.13; `benchmarks/results/peers-cpu.json`" in section
    assert "| shape | precision | mode | framework | status | tokens_per_s | step_ms |" in section


def test_a_failed_round_fails_the_run_and_unequal_models_stop_it(tmp_path, monkeypatch, capsys):
    ok = _fake_measure()

    def measure(framework, shape, precision, mode, args, peers_python):
        if framework != "torchtitan":
            return ok(framework, shape, precision, mode, args, peers_python)
        if shape == "tiny":
            return {"params": None, "peak_rss_kib": 512, "train_rss_kib": None, "step_times_s": [], "patches": [],
                    "versions": [], "status": "failed", "reason": "exit code 1: ImportError: no torchtitan"}
        return ok(framework, shape, precision, mode, args, peers_python) | {"params": 999}

    # the debug shape: ember builds 1,000 parameters, torchtitan 999; not the same model, so no comparison
    assert _main(tmp_path, monkeypatch, measure, "--frameworks", "ember,torchtitan") == 2
    assert capsys.readouterr().err == ("error: shape debug: ember builds 1,000 parameters but torchtitan 999: not the "
                                       "same model, so the comparison would not mean anything\n")
    assert _main(tmp_path, monkeypatch, measure, "--frameworks", "ember,torchtitan", "--shapes", "tiny") == 1
    rows = json.loads((tmp_path / "out" / "peers-cpu.json").read_text())["rows"]
    assert [(r["framework"], r["status"], r["reason"]) for r in rows] == [
        ("ember", "ok", None), ("torchtitan", "failed", "round 1: exit code 1: ImportError: no torchtitan")]
