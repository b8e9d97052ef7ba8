"""The report page in a real browser: headless Chromium (Debian's `chromium`, installed by the README's test
command) loads every figure and logs no error; a screenshot of it decodes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from matplotlib.image import imread

from ember.report import build_report

sys.path.insert(0, str(Path(__file__).parent))
from browser import CHROMIUM, Browser  # noqa: E402  (a helper beside this file, also a script for docs/report.png)


@pytest.mark.slow
def test_report_opens_in_chromium_with_every_figure_and_no_errors(tiny_run: tuple[Path, str], tmp_path: Path):
    # Never skipped: without the browser this test fails, saying how to install it.
    assert CHROMIUM is not None, ("chromium is not installed: apt-get install -y chromium "
                                  "(the README's test command does)")
    report = build_report([tiny_run[0]], tmp_path / "report.html")
    browser = Browser()
    try:
        browser.open(report.html)
        images = browser.evaluate("Array.from(document.images).map(i => [i.closest('figure').id, i.complete, "
                                  "i.naturalWidth, i.naturalHeight])")
        title = browser.evaluate("document.title")
        browser.screenshot(tmp_path / "shot.png")
        errors = browser.errors()
    finally:
        browser.close()
    assert images == [[f"fig-{plot.name}", True, 800, 450] for plot in report.plots] and len(images) == 7
    assert errors == []
    assert title == "ember report: tiny"
    assert imread(tmp_path / "shot.png").shape[:2] == (900, 1200)
