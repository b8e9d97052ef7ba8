"""The report's one self-contained HTML page: tables, figures as data: URIs, and the data behind them as
JSON in a non-executed <script type="application/json"> (no script runs, nothing is fetched)."""

from __future__ import annotations

import base64
import datetime
import html
import json
from typing import Any, Optional

from ember.report.figures import Plot, finite
from ember.report.runs import Run

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 1em 0 2em; }
figure img { max-width: 100%; border: 1px solid #eee; }
.notes li { color: #8a4b00; }
code { background: #f3f3f3; padding: 0 0.2em; }
"""


def _number(value: Optional[float], spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "–"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _tokens(value: Optional[float]) -> str:
    if value is None:
        return "–"
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= size:
            return f"{value / size:.3g}{unit}"
    return f"{value:.0f}"


def _at(value: Optional[float], step: Optional[int]) -> str:
    return "–" if value is None else f"{value:.4f} (step {step})"


# The summary table's rows: (label, how to show one run's summary dict).
SUMMARY_ROWS: list[tuple[str, Any]] = [
    ("steps", lambda s: "–" if s["steps"] is None
     else f"{s['steps']}" + (f" of {s['max_steps']}" if s["max_steps"] else "")),
    ("tokens seen", lambda s: _tokens(s["tokens"])),
    ("train time (sum of step times)", lambda s: _duration(s["train_time_s"])),
    ("final train loss (last window mean)", lambda s: _at(s["final_loss"], s["final_loss_step"])),
    ("best train loss (window mean)", lambda s: _number(s["best_loss"], ".4f")),
    ("final validation loss", lambda s: _number(s["final_val_loss"], ".4f")),
    ("best validation loss", lambda s: _at(s["best_val_loss"], s["best_val_step"])),
    ("median tokens/s", lambda s: _number(s["median_tokens_per_s"], ",.0f")),
    ("median MFU", lambda s: "–" if s["median_mfu"] is None else f"{s['median_mfu']:.1%}"
     + ("? (against a provisional peak)" if s["mfu_provisional"] else "")),
    ("model", lambda s: s["model"] or "–"),
    ("mesh", lambda s: s["mesh"] or "–"),
    ("device", lambda s: s["device"] or "–"),
    ("checkpoints", lambda s: ", ".join(f"step-{n}" for n in s["checkpoints"]) or "none"),
    ("skipped steps", lambda s: str(s["skipped_steps"])),
    ("loss spikes", lambda s: str(s["loss_spikes"])),
    ("steps without some replica groups", lambda s: "–" if s["degraded_steps"] is None else str(s["degraded_steps"])),
]


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _show(value: Any) -> str:
    return "(absent)" if value is None else json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def render(runs: list[Run], plots: list[Plot], missing: list[str], differences: dict[str, list[Any]]) -> str:
    """The whole page as one string."""
    names = [run.name for run in runs]
    summaries = {run.name: run.summary() for run in runs}
    parts = [f"<h1>ember report: {html.escape(', '.join(names))}</h1>",
             f"<p>Made {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')} from "
             + ", ".join(f"<code>{html.escape(str(run.path))}</code>" for run in runs) + ".</p>"]
    notes = [f"{run.name}: {note}" for run in runs for note in run.notes] + missing
    if notes:
        parts.append('<h2>Notes</h2><ul class="notes">' + "".join(f"<li>{html.escape(n)}</li>" for n in notes)
                     + "</ul>")
    parts.append("<h2>Summary</h2>" + _table([""] + names, [[label] + [show(summaries[n]) for n in names]
                                                           for label, show in SUMMARY_ROWS]))
    if len(runs) > 1:
        rows = [[key] + [_show(v) for v in values] for key, values in differences.items()]
        parts.append("<h2>Config differences</h2>" + (_table(["key"] + names, rows) if rows else
                                                       "<p>The runs' configs are the same (output_dir aside).</p>"))
    eval_rows = [[run.name, f"step-{step}", task, metric, _show(value)]
                 for run in runs for step, results in sorted(run.evals.items())
                 for task, metrics in results.items() for metric, value in metrics.items()]
    if eval_rows:
        parts.append("<h2>Evaluations (eval.json)</h2>"
                     + _table(["run", "checkpoint", "task", "metric", "value"], eval_rows))
    parts.append("<h2>Figures</h2>")
    for plot in plots:
        data = base64.b64encode(plot.png).decode("ascii")
        parts.append(f'<figure id="fig-{plot.name}"><img alt="{html.escape(plot.title)}" width="800" '
                     f'height="450" src="data:image/png;base64,{data}"></figure>')
    data = {"runs": names, "summary": summaries, "config_differences": differences,
            "figures": {plot.name: plot.series for plot in plots}}
    # "</" cannot close the script early once escaped; NaN is not JSON.
    payload = json.dumps(_finite_tree(data)).replace("</", "<\\/")
    parts.append(f'<script type="application/json" id="ember-report-data">{payload}</script>')
    return ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>ember report: {html.escape(', '.join(names))}</title><style>{STYLE}</style></head>"
            f"<body>{''.join(parts)}</body></html>\n")


def _finite_tree(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _finite_tree(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [_finite_tree(v) for v in node]
    return finite(node)
