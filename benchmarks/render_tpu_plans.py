"""docs/tpu.md's plan table and each TPU recipe's plan lines, from what `ember plan RECIPE --world N --device tpu-X`
says of every recipe with device=tpu now (the per-role model's verdict; not the XLA figure, which compiles for
minutes). The chips and the TPU come from the recipe's name (llama3.1-405b-2xv6e-256: two v6e-256 slices). The
table sits between the page's two markers, the plan lines are a recipe header's `# Planned:` line and the next;
neither is edited by hand: tests/test_tpu_recipes.py plans each recipe and fails when either differs from what
this script writes, or when a recipe does not fit its plan at the largest micro-batch that fits.

    python benchmarks/render_tpu_plans.py            # rewrite the table and the recipes' plan lines
    python benchmarks/render_tpu_plans.py --check    # exit 1 if any is stale
"""

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

from ember import config as config_lib
from ember.parallel.mesh_shape import resolve_mesh
from ember.plan.planner import make_plan
from ember.train import run as run_lib

PAGE = Path(__file__).resolve().parent.parent / "docs" / "tpu.md"
BEGIN = "<!-- plan table: written by python benchmarks/render_tpu_plans.py from ember plan; do not edit -->"
END = "<!-- end of the plan table -->"
SLICES = re.compile(r"-(?:(\d+)x)?(v\d+[a-z]*)-(\d+)$")  # ...-2xv6e-256: slices, TPU, chips per slice
PLAN_LINES = re.compile(r"^# Planned: .*\n#.*$", re.M)  # a recipe header's two
GIB = 2**30


@dataclass(frozen=True)  # (no `from __future__ import annotations`: the tests load this script outside sys.modules)
class PlanRow:
    """What the plan says of one recipe at its own micro-batch."""

    recipe: str
    world: int
    device: str
    mesh: str
    remat: str
    micro_batch: int
    accumulated: int
    peak_gib: float
    usable_gib: float
    fits: bool
    largest: int | None  # the largest micro-batch that fits (None: none does)


def tpu_recipes() -> list[str]:
    """Every built-in recipe with device=tpu, by name."""
    return [name for name in config_lib.recipe_names() if config_lib.load(name).device == "tpu"]


def chips(recipe: str) -> tuple[int, str]:
    """(chips, `ember plan --device`) from a TPU recipe's name: llama3.1-405b-2xv6e-256 -> (512, tpu-v6e)."""
    match = SLICES.search(recipe)
    if match is None:
        raise ValueError(f"{recipe}: a TPU recipe's name ends with its slices, as llama3-8b-v6e-256 or ...-2xv6e-256")
    slices, tpu, per_slice = match.groups()
    return int(slices or 1) * int(per_slice), f"tpu-{tpu}"


def plan_row(recipe: str) -> PlanRow:
    """`ember plan RECIPE --world N --device tpu-X`'s figures (make_plan, as the command runs it)."""
    world, device = chips(recipe)
    cfg = run_lib.load_config(recipe, [], world_size=world)
    plan = make_plan(cfg, world, None, device)
    dp = resolve_mesh(cfg.ici_mesh, cfg.dcn_mesh, world).dp
    return PlanRow(recipe, world, device, plan.mesh, cfg.model.remat, cfg.micro_batch_size,
                   config_lib.grad_accum_steps(cfg, dp), round(max(r.peak_bytes for r in plan.ranks) / GIB, 2),
                   round(plan.usable_bytes / GIB, 2), plan.fits, plan.max_micro_batch)


def table_line(row: PlanRow) -> str:
    """The page's table row for one recipe."""
    return (f"| {row.recipe} | {row.world} x {row.device} | {row.mesh} | {row.remat} | {row.micro_batch} x "
            f"{row.accumulated} | {row.peak_gib:.2f} | {row.usable_gib:.2f} | {row.largest or 'none'} |")


def table(rows: list[PlanRow]) -> str:
    """The page's block: the markers around the table."""
    head = ["| recipe | chips | mesh | model.remat | micro-batch x accumulated | planned peak GiB | usable GiB | "
            "largest micro-batch that fits |", "|---|---|---|---|---|---|---|---|"]
    return "\n".join([BEGIN, *head, *(table_line(row) for row in rows), END])


def plan_lines(row: PlanRow) -> str:
    """The recipe header's two plan lines: the command, and what it says."""
    verdict = "fits" if row.fits else "does not fit"
    largest = (", the largest that fits" if row.largest == row.micro_batch
               else f" (the largest that fits: {row.largest or 'none'})")
    return (f"# Planned: `ember plan {row.recipe} --world {row.world} --device {row.device}`\n"
            f"# {verdict}: peak {row.peak_gib:.2f} of {row.usable_gib:.2f} GiB usable per chip at micro-batch "
            f"{row.micro_batch}{largest}")


def with_table(page: str, rows: list[PlanRow]) -> str:
    """`page` with the block between its markers replaced by the table of `rows`."""
    start, end = page.index(BEGIN), page.index(END) + len(END)
    return page[:start] + table(rows) + page[end:]


def with_plan_lines(recipe_text: str, row: PlanRow) -> str:
    """A recipe's text with its header's plan lines replaced by `row`'s."""
    if not PLAN_LINES.search(recipe_text):
        raise ValueError(f"{row.recipe}: its header has no two lines starting '# Planned:' to write")
    return PLAN_LINES.sub(lambda _: plan_lines(row), recipe_text, count=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="only compare: exit 1 if the table or a recipe's plan lines are stale")
    args = parser.parse_args()
    rows = [plan_row(recipe) for recipe in tpu_recipes()]
    files = {PAGE: with_table(PAGE.read_text(), rows)}
    for row in rows:
        path = config_lib.resolve_recipe(row.recipe)
        files[path] = with_plan_lines(path.read_text(), row)
    stale = [path for path, text in files.items() if path.read_text() != text]
    for path in stale:
        if not args.check:
            path.write_text(files[path])
        print(f"{path}: {'stale: run python benchmarks/render_tpu_plans.py' if args.check else 'rewritten'}")
    if not stale:
        print("the plan table and the recipes' plan lines are up to date")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
