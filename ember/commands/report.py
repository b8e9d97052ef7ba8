"""`ember report RUN [RUN ...] [--output FILE.html] [--png DIR]`: an HTML page and PNGs of a run's curves, or of
runs compared (ember/report)."""

from __future__ import annotations

import argparse

from ember.usage import ArgumentParser


def parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="ember report", description="An HTML page (self-contained: open it anywhere) and PNGs of a run's curves "
        "and summary; of several runs, the curves overlaid and the config keys that differ. A run still training, "
        "or killed and resumed, is read as it is (the last record of each step).")
    p.add_argument("runs", nargs="+", metavar="RUN", help="an `ember train` output_dir, local or a URL (s3://...)")
    p.add_argument("--output", metavar="FILE.html", default=None,
                   help="the page, a path or a URL (default: RUN/report.html for one run, on the store for a URL; "
                   "./report.html for several)")
    p.add_argument("--png", metavar="DIR", default=None,
                   help="where the figures go as PNGs (default: the page's path without .html, e.g. RUN/report/)")
    return p


def parse(argv: list[str]) -> argparse.Namespace:
    return parser().parse_args(argv)


def run(args: argparse.Namespace) -> int:
    from ember.report import build_report

    report = build_report(args.runs, args.output, args.png)
    for note in report.missing + [f"{entry.name}: {note}" for entry in report.runs for note in entry.notes]:
        print(f"note: {note}")
    count = len(report.plots)
    print(f"wrote {report.html} and {count} figure{'' if count == 1 else 's'} in {report.png_dir}/")
    return 0
