"""`ember report RUN [RUN ...]`: one self-contained HTML page and PNGs of a run's curves, or of several runs
overlaid with the config keys that differ between them.

    runs.py     reading a run directory (last record per step, cut lines skipped), summary, config diff
    figures.py  the matplotlib figures, each keeping the series it plots
    page.py     the HTML page
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from ember.errors import ConfigError, DataError
from ember.report.figures import FIGURES, OPTIONAL, Plot, all_plots
from ember.report.runs import Run, config_differences, fetch_run, read_run, unique_names
from ember.storage.location import Location, as_path, check_input, check_output

__all__ = ["Report", "build_report", "read_run", "Run", "Plot"]

@dataclass
class Report:
    html: Location
    png_dir: Location
    runs: list[Run]
    plots: list[Plot]
    missing: list[str]  # figures left out, and why


def build_report(paths: Sequence[str | Path], output: Optional[str | Path] = None,
                 png_dir: Optional[str | Path] = None) -> Report:
    """Read the runs, draw the figures, write the HTML page and the PNGs; returns what was written. A run, the
    page and the PNG folder may be URLs (s3://...): a run's files are copied from the store into a temporary
    folder and read there (fetch_run); the page and PNGs are written locally and uploaded. The default place for
    the page of one run is the run itself, on the store for a URL."""
    from ember.report.page import render

    if not paths:
        raise ConfigError("give at least one run directory: ember report RUN [RUN ...]")
    given = [str(p) for p in paths]
    for run in given:  # a URL's bucket, credentials and prefix, one line each before any work
        check_input(run, "RUN")
    check_output(None if output is None else str(output), "--output")
    check_output(None if png_dir is None else str(png_dir), "--png")
    locations = [as_path(p) for p in given]
    html_path = as_path(str(output)) if output else (locations[0] / "report.html" if len(locations) == 1
                                                     else Path("report.html"))
    if html_path.suffix != ".html":
        raise ConfigError(f"--output must name an .html file, got '{html_path}'")
    png_path = as_path(str(png_dir)) if png_dir else html_path.with_suffix("")
    with tempfile.TemporaryDirectory(prefix="ember-report-") as scratch:
        runs = []
        for index, (location, name) in enumerate(zip(locations, unique_names(given))):
            local = location if isinstance(location, Path) else fetch_run(location, Path(scratch) / f"run-{index}")
            run = read_run(local, name)
            run.path = location  # the page names the run as given
            runs.append(run)
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
        page = render(runs, plots, missing, config_differences(runs))
        for plot in plots:
            _write(png_path / f"{plot.name}.png", plot.png)
        _write(html_path, page.encode("utf-8"))
    return Report(html_path, png_path, runs, plots, missing)


def _write(target: Location, data: bytes) -> None:
    """A file written locally, or on a store as one object (applied whole)."""
    if isinstance(target, Path):
        target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
