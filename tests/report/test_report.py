"""`ember report` on real runs: every figure is there, the plotted series are metrics.jsonl's values, runs
compare by their differing config keys, a resumed run shows each step once, bad input is said in one line."""

from __future__ import annotations

import json
import re
import shutil
import statistics
from pathlib import Path

import pytest
from matplotlib.image import imread

from ember.cli import main
from ember.report import build_report
from ember.report.figures import smooth, smoothing_weight
from tests.helpers import read_records

FIGURES = {"loss_steps", "loss_tokens", "lr", "grad_norm", "throughput", "memory", "data_wait"}


def _embedded(html: str) -> dict:
    match = re.search(r'<script type="application/json" id="ember-report-data">(.*?)</script>', html, re.S)
    return json.loads(match.group(1).replace("<\\/", "</"))


def _column(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    rows = [r for r in rows if r.get(key) is not None]
    return [r["step"] for r in rows], [r[key] for r in rows]


@pytest.mark.slow
def test_report_of_a_real_run(tiny_run: tuple[Path, str], tmp_path: Path):
    run, printed = tiny_run
    assert f"see the run: ember report {run}" in printed  # `ember train` ends with the command
    report = build_report([run], tmp_path / "r.html", tmp_path / "png")
    plots = {plot.name: plot for plot in report.plots}
    assert set(plots) == FIGURES and report.missing == [] and report.runs[0].notes == []
    for name in FIGURES:  # the PNGs decode, 800 x 450 each
        assert imread(tmp_path / "png" / f"{name}.png").shape[:2] == (450, 800)
    rows = read_records(run)
    train_rows = [r for r in rows if "loss" in r]
    series = {name: plot.series["tiny"] for name, plot in plots.items()}
    steps, loss = _column(rows, "loss")
    assert steps == list(range(2, 21, 2))
    assert series["loss_steps"]["train loss"] == {"x": steps, "y": loss}
    assert series["loss_tokens"]["train loss"] == {"x": [r["tokens_seen"] for r in train_rows], "y": loss}
    assert series["loss_steps"]["val loss"] == dict(zip(("x", "y"), _column(rows, "val_loss")))
    assert series["loss_steps"]["val loss"]["x"] == [10, 20]
    assert series["loss_tokens"]["val loss"]["x"] == [640, 1280]  # 2 x 32 tokens per step
    for name, keys in {"lr": ["lr"], "grad_norm": ["grad_norm"], "throughput": ["tokens_per_s", "mfu"],
                       "memory": ["memory_gb"], "data_wait": ["data_wait_frac"]}.items():
        for key in keys:
            assert series[name][key] == dict(zip(("x", "y"), _column(rows, key))), key
    smoothed = series["loss_steps"]["train loss (smoothed)"]["y"]
    assert smoothing_weight(10) == 0 and smoothed == pytest.approx(loss)  # 10 points: nothing to average over
    w = smoothing_weight(20)
    assert w == 0.5 and smooth([4.0, 2.0], w) == pytest.approx([4.0, (w * (1 - w) * 4 + (1 - w) * 2) / (1 - w**2)])

    summary = report.runs[0].summary()
    assert summary["steps"] == 20 and summary["tokens"] == 1280 and summary["checkpoints"] == [10, 20]
    assert summary["final_loss"] == train_rows[-1]["loss_avg"]
    assert summary["best_val_loss"] == min(series["loss_steps"]["val loss"]["y"])
    assert summary["median_tokens_per_s"] == statistics.median(r["tokens_per_s"] for r in train_rows)
    assert summary["median_mfu"] == statistics.median(r["mfu"] for r in train_rows)
    assert summary["train_time_s"] == pytest.approx(sum(2 * r["step_time_s"] for r in train_rows))
    assert summary["mesh"] == "single device" and summary["device"]  # run.json: the CPU's model name

    html = (tmp_path / "r.html").read_text()
    assert all(f'id="fig-{name}"' in html for name in FIGURES)
    assert html.count('src="data:image/png;base64,') == len(FIGURES)
    assert not re.search(r'(src|href)="(https?:)?//', html)  # nothing fetched from a network
    data = _embedded(html)
    assert data["figures"] == {name: plot.series for name, plot in plots.items()}
    assert data["summary"]["tiny"]["steps"] == 20


@pytest.mark.slow
def test_cli_defaults_and_help(tiny_run: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture):
    run = tmp_path / "copy"
    shutil.copytree(tiny_run[0], run)
    assert main(["report", str(run)]) == 0
    assert (run / "report.html").is_file() and {p.stem for p in (run / "report").glob("*.png")} == FIGURES
    assert f"wrote {run / 'report.html'}" in capsys.readouterr().out
    assert main(["report", "--help"]) == 0 and "--png DIR" in capsys.readouterr().out


@pytest.mark.slow
def test_two_runs_overlaid_with_exactly_the_differing_keys(tiny_run: tuple[Path, str], tmp_path: Path, train):
    other = tmp_path / "other"
    train(other, "max_steps=6", "optim.lr=0.001", "seed=3")
    report = build_report([tiny_run[0], other], tmp_path / "cmp.html")
    assert report.png_dir == tmp_path / "cmp"
    data = _embedded((tmp_path / "cmp.html").read_text())
    assert data["config_differences"] == {  # output_dir aside, which every run has its own
        "max_steps": [20, 6], "optim.lr": [0.002, 0.001], "seed": [0, 3], "eval_interval": [10, 0],
        "checkpoint.interval": [10, 50], "checkpoint.keep": [0, 3]}
    html = (tmp_path / "cmp.html").read_text()
    assert "<h2>Config differences</h2>" in html and "<td>optim.lr</td><td>0.002</td><td>0.001</td>" in html
    loss = {p.name: p for p in report.plots}["loss_steps"].series
    assert set(loss) == {"tiny", "other"}
    assert loss["other"]["train loss"] == dict(zip(("x", "y"), _column(read_records(other), "loss")))


@pytest.mark.slow
def test_moe_run_has_the_expert_load_heat_map(tmp_path: Path, train):
    run = tmp_path / "moe"
    train(run, "model.family=mixtral", "model.n_layers=2", "max_steps=4")
    report = build_report([run])
    plots = {plot.name: plot for plot in report.plots}
    assert imread(run / "report" / "moe_load.png").shape[:2] == (450, 800)
    rows = [r for r in read_records(run) if "loss" in r]
    for layer in (0, 1):
        summed = [sum(r[f"moe/layer{layer}/tokens_per_expert"][e] for r in rows) for e in range(8)]
        assert plots["moe_load"].series["moe"][f"layer{layer}"] == {"x": list(range(8)), "y": summed}
        # each step routes every token of the batch to top_k=2 experts: 2 x 64 x 2 steps per window
        assert sum(summed) == 2 * 64 * 4


@pytest.mark.slow
def test_killed_and_resumed_run_shows_each_step_once(tiny_run: tuple[Path, str], tmp_path: Path, train):
    run = tmp_path / "resumed"
    shutil.copytree(tiny_run[0], run)
    shutil.rmtree(run / "checkpoints" / "step-20")  # killed after step 20's record, before its checkpoint
    train(run, "max_steps=20", "eval_interval=10", "checkpoint.interval=10", "checkpoint.keep=0")  # 11..20 again
    report = build_report([run])
    loss = {p.name: p for p in report.plots}["loss_steps"].series["resumed"]["train loss"]
    assert loss["x"] == list(range(2, 21, 2))
    # A file that logged the replayed steps again (the last record of a step wins, wherever it is)
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 4, "loss": 1.5, "loss_avg": 1.5, "tokens_seen": 256}) + "\n")
    report = build_report([run])
    loss = {p.name: p for p in report.plots}["loss_steps"].series["resumed"]["train loss"]
    assert loss["x"] == list(range(2, 21, 2)) and loss["y"][1] == 1.5


def test_spikes_and_skipped_steps_are_marked(tmp_path: Path):
    run = tmp_path / "marks"
    run.mkdir()
    rows = [{"step": s, "loss": 5.0, "loss_avg": 5.0, "tokens_seen": 10 * s} for s in range(1, 11)]
    rows += [{"step": 6, "loss_spike": 30.0, "loss_mean": 5.0, "data_position": {"epoch": 0, "cursor": 12}},
             {"step": 8, "skipped_step": 1, "skipped_loss": None, "skipped_grad_norm": None}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = build_report([run])
    series = {p.name: p for p in report.plots}["loss_tokens"].series["marks"]
    assert series["loss spike"] == {"x": [60.0], "y": [30.0]} and series["skipped step"]["x"] == [80.0]
    assert report.runs[0].summary()["skipped_steps"] == 1 and report.runs[0].summary()["loss_spikes"] == 1
    assert any("no config.yaml" in note for note in report.runs[0].notes)


def test_mfu_against_a_provisional_peak_keeps_its_mark(tmp_path: Path):
    """The console's `MFU 58.1%?` (divided by a peak measured while the machine was busy) stays marked in the
    report: one provisional record marks the run's median."""
    from ember.report.page import SUMMARY_ROWS

    show = dict(SUMMARY_ROWS)["median MFU"]
    for name, provisional in (("quiet", [False, False]), ("busy", [False, True]), ("unrecorded", [None, None])):
        run = tmp_path / name
        run.mkdir()
        rows = [{"step": s, "loss": 5.0, "mfu": 0.5 + s / 100, "mfu_provisional": p}
                for s, p in zip((1, 2), provisional)]
        (run / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if v is not None}) + "\n"
                                                   for r in rows))
        summary = build_report([run]).runs[0].summary()
        assert summary["mfu_provisional"] is (name == "busy")
        assert show(summary) == ("51.5%? (against a provisional peak)" if name == "busy" else "51.5%")


@pytest.mark.slow
def test_eval_json_of_a_checkpoint_is_listed(tiny_run: tuple[Path, str], tmp_path: Path):
    run = tmp_path / "evaluated"
    shutil.copytree(tiny_run[0], run)
    results = {"ppl": {"perplexity": 123.5, "tokens": 4096}}
    (run / "checkpoints" / "step-20" / "eval.json").write_text(json.dumps({"model": str(run), "step": 20,
                                                                           "results": results}))
    report = build_report([run])
    assert report.runs[0].evals == {20: results}
    assert "<td>evaluated</td><td>step-20</td><td>ppl</td><td>perplexity</td><td>123.5</td>" in report.html.read_text()


@pytest.mark.slow
def test_bad_input_is_one_line_or_said_in_the_report(tiny_run: tuple[Path, str], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("not a run")
    for path, message in ((empty, "is not an ember run: it has neither metrics.jsonl nor config.yaml"),
                          (tmp_path / "missing", "no run directory at")):
        assert main(["report", str(path)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    # A run that has not logged yet: one line saying so, and nothing written (no page of empty axes)
    starting = tmp_path / "starting"
    starting.mkdir()
    shutil.copy(tiny_run[0] / "config.yaml", starting / "config.yaml")
    assert main(["report", str(starting)]) == 2
    assert capsys.readouterr().err == (f"error: nothing to report yet: '{starting}' logged no metrics (no record in "
                                       "metrics.jsonl); run ember report again once training has logged a step "
                                       "(every logging_steps)\n")
    assert sorted(p.name for p in starting.iterdir()) == ["config.yaml"]
    # Beside a run that has logged, it is a note on the page of the other
    assert main(["report", str(tiny_run[0]), str(starting), "--output", str(tmp_path / "both.html")]) == 0
    printed = capsys.readouterr().out
    assert "note: starting: no metrics.jsonl yet" in printed and f"and {len(FIGURES)} figures in" in printed
    # A run killed mid-write: the cut last line is skipped and named
    cut = tmp_path / "cut"
    shutil.copytree(tiny_run[0], cut)
    text = (cut / "metrics.jsonl").read_text()
    (cut / "metrics.jsonl").write_text(text + '{"step": 22, "loss": 9.1, "lr')
    assert main(["report", str(cut)]) == 0
    assert "its last line is not a whole record" in capsys.readouterr().out
    report = build_report([cut])
    assert report.runs[0].summary()["steps"] == 20
    assert "its last line is not a whole record" in (cut / "report.html").read_text()
    assert main(["report", str(cut), "--output", str(tmp_path / "page.txt")]) == 2


def test_one_figure_is_counted_as_one(tmp_path: Path, capsys: pytest.CaptureFixture):
    run = tmp_path / "lr-only"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "lr": 0.001}) + "\n")
    assert main(["report", str(run)]) == 0
    assert capsys.readouterr().out.endswith(f"wrote {run / 'report.html'} and 1 figure in {run / 'report'}/\n")
    assert [p.name for p in (run / "report").iterdir()] == ["lr.png"]


def test_a_fault_tolerant_runs_steps_without_some_groups_are_counted(tmp_path: Path):
    from ember.report.page import SUMMARY_ROWS

    run = tmp_path / "groups"
    run.mkdir()
    (run / "config.yaml").write_text("max_steps: 4\nfault_tolerance:\n  enable: true\n  replica_groups: 2\n")
    rows = [{"step": s, "loss": 5.0, "loss_avg": 5.0, "tokens_seen": 10 * s} for s in range(1, 5)]
    rows += [{"step": s, "replica_groups": [0], "replica_groups_missing": 1, "tokens": 5} for s in (2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    show = dict(SUMMARY_ROWS)["steps without some replica groups"]
    assert show(build_report([run]).runs[0].summary()) == "2"
    (run / "config.yaml").write_text("max_steps: 4\n")
    assert show(build_report([run]).runs[0].summary()) == "–"
