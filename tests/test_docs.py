"""The documentation stays true to the repository: docs/performance.md is what benchmarks/render_performance.py
renders from benchmarks/results/*.json now, docs/tpu.md's plan table is benchmarks/render_tpu_plans.py's (its
figures against a fresh `ember plan` of each recipe: tests/test_tpu_recipes.py), and every relative link in
README.md and docs/*.md reaches a file (and, with an #anchor into a markdown page, a heading of that page)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers import load_benchmark

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# [text](target) outside code spans; images too. Targets with a scheme (https:, mailto:) are not files.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def load_renderer():
    return load_benchmark("render_performance")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = CODE_SPAN.sub(lambda m: m.group(0)[1:-1], heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def links(page: Path) -> list[str]:
    text = CODE_SPAN.sub("", FENCE.sub("", page.read_text()))
    return [target for target in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", target)]


def test_performance_page_is_rendered_from_the_results_files():
    renderer = load_renderer()
    page = (ROOT / "docs" / "performance.md").read_text()
    assert page == renderer.render(), "docs/performance.md is stale: run python benchmarks/render_performance.py"


def test_performance_page_has_a_section_per_results_file_with_its_date_and_torch():
    renderer = load_renderer()
    page = renderer.render()
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        assert f"\n## {path.stem}\n" in page, path.name
    default_run = page.split("\n## default_run-cpu\n", 1)[1].split("\n## ", 1)[0]
    assert "Measured on 20" in default_run and "torch 2." in default_run, default_run[:400]


def test_render_formats_numbers_and_tables():
    renderer = load_renderer()
    assert [renderer.format_value(v) for v in (1234567, 4837.22, 1.10681, 0.0001837, True, None, ["a=1", "b=2"])] == [
        "1,234,567", "4,837", "1.107", "0.0001837", "yes", "", "a=1 b=2"]
    assert renderer.table([{"a": 1, "b": [1.0, 2.0]}, {"a": 2, "c": "x|y"}]) == [
        "| a | c |", "|---|---|", "| 1 |  |", "| 2 | x\\|y |"]


def test_tpu_plan_table_is_the_generators_with_a_row_per_tpu_recipe():
    """docs/tpu.md's plan table lies between render_tpu_plans.py's markers, one row per device=tpu recipe in its order
    (each row's figures are compared with a fresh plan, seconds per recipe, in tests/test_tpu_recipes.py)."""
    renderer = load_benchmark("render_tpu_plans")
    page = renderer.PAGE.read_text()
    assert page.count(renderer.BEGIN) == page.count(renderer.END) == 1
    lines = page[page.index(renderer.BEGIN):page.index(renderer.END) + len(renderer.END)].splitlines()
    assert lines[:3] + lines[-1:] == renderer.table([]).splitlines()
    assert [line.split(" | ")[0].removeprefix("| ") for line in lines[3:-1]] == renderer.tpu_recipes()


def test_every_relative_link_reaches_a_file_and_heading():
    broken = []
    for page in PAGES:
        for target in links(page):
            path_part, _, anchor = target.partition("#")
            destination = (page.parent / path_part).resolve() if path_part else page
            if not destination.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no heading '{anchor}')")
    assert not broken, "\n".join(broken)


def test_the_link_checker_sees_links_and_headings(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Reports: `ember report`\n\nsee [a](other.md#x), `[not](a-link.md)`, ![img](p.png)\n"
                    "```\n[nor](this.md)\n```\n[web](https://example.com)\n")
    assert links(page) == ["other.md#x", "p.png"]
    assert anchors(page) == {"reports-ember-report"}


def test_readme_is_a_guide():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", readme), "dated entries belong in CHANGELOG.md"
    for page in ("training-and-config", "data", "checkpoints", "fine-tuning", "parallelism", "plan", "clusters",
                 "eval-and-generate", "metrics-and-reports", "fp8-and-profiling", "performance"):
        assert f"(docs/{page}.md" in readme, page
