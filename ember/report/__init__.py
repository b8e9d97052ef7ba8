"""`ember report RUN [RUN ...]`: one self-contained HTML page and PNGs of a run's curves, or of several runs
overlaid with the config keys that differ between them.

    runs.py     reading a run directory (last record per step, cut lines skipped), summary, config diff
    figures.py  the matplotlib figures, each keeping the series it plots
    page.py     the HTML page
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from ember.errors import ConfigError, DataError
from ember.report.figures import FIGURES, OPTIONAL, Plot, all_plots
from ember.report.runs import Run, config_differences, read_run, unique_names

__all__ = ["Report", "build_report", "read_run", "Run", "Plot"]

@dataclass
class Report:
    html: Path
    png_dir: Path
    runs: list[Run]
    plots: list[Plot]
    missing: list[str]  # figures left out, and why


def build_report(paths: Sequence[str | Path], output: Optional[str | Path] = None,
                 png_dir: Optional[str | Path] = None) -> Report:
    """Read the runs, draw the figures, write the HTML page and the PNGs; returns what was written."""
    from ember.report.page import render

    if not paths:
        raise ConfigError("give at least one run directory: ember report RUN [RUN ...]")
    paths = [Path(p) for p in paths]
    runs = [read_run(p, name) for p, name in zip(paths, unique_names(paths))]
    html_path = Path(output) if output else (paths[0] / "report.html" if len(paths) == 1 else Path("report.html"))
    if html_path.suffix != ".html":
        raise ConfigError(f"--output must name an .html file, got '{html_path}'")
    png_path = Path(png_dir) if png_dir else html_path.with_suffix("")
    plots, missing = [], []
    for (name, needs), plot in zip(FIGURES, all_plots(runs)):
        if plot is None and name not in OPTIONAL:
            missing.append(f"no {name} figure: no run has {needs} in metrics.jsonl")
        elif plot is not None:
            plots.append(plot)
    if not plots:  # a page of empty axes would look like a report; nothing is written instead
        names = ", ".join(f"'{run.path}'" for run in runs)
        raise DataError(f"nothing to report yet: {names} logged no metrics (no record in metrics.jsonl); run "
                        "ember report again once training has logged a step (every logging_steps)")
    html_path.parent.mkdir(parents=True, exist_ok=True)
    png_path.mkdir(parents=True, exist_ok=True)
    for plot in plots:
        (png_path / f"{plot.name}.png").write_bytes(plot.png)
    html_path.write_text(render(runs, plots, missing, config_differences(runs)), encoding="utf-8")
    return Report(html_path, png_path, runs, plots, missing)
