"""How long `ember plan` takes on this CPU for the full-scale jobs docs/plan.md and tests/plan/ use: Llama 3.1 405B
on 1024 H100s (data=8 x fsdp=16 x tensor=8, docs/plan.md's example) and Mixtral 8x22B with expert=8 on 64.
tests/plan/test_plan.py checks what these plans say; how fast they are is measured here, where a slow shared
machine reads as a figure rather than a failed test.

    python benchmarks/plan_speed.py
    python benchmarks/plan_speed.py --rounds 5

Prints a table (the median and the fastest of --rounds plans per job) and writes
benchmarks/results/plan_speed-<device>.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from ember.plan.planner import make_plan
from ember.train import run as run_lib
from results_file import write_results

# (name, recipe, overrides, world size): the same jobs as tests/plan/test_plan.py
JOBS = [
    ("llama3.1-405b data=8 x fsdp=16 x tensor=8", "llama3.1-405b",
     ["ici_mesh.tensor=8", "ici_mesh.fsdp=1", "dcn_mesh.fsdp=16", "dcn_mesh.data=8", "model.remat=full"], 1024),
    ("mixtral 8x22B expert=8 x data=8", "mixtral-8x7b",
     ["model.flavor=8x22B", "ici_mesh.expert=8", "ici_mesh.fsdp=1", "dcn_mesh.data=8", "global_batch_size=64",
      "micro_batch_size=1"], 64),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="plans per job (default: 3)")
    parser.add_argument("--device", default="h100", help="the planned device (default: h100)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    rows = []
    print(f"{'job':<44}{'ranks':>6}{'median s':>10}{'best s':>8}  fits")
    for name, recipe, overrides, world in JOBS:
        cfg = run_lib.load_config(recipe, overrides, world_size=world)
        seconds, fits = [], None
        for _ in range(args.rounds):
            start = time.perf_counter()
            plan = make_plan(cfg, world, device=args.device)
            seconds.append(time.perf_counter() - start)
            fits = plan.to_json()["fits"]
        row = {"job": name, "recipe": recipe, "overrides": overrides, "world_size": world, "fits": fits,
               "seconds": seconds, "median_s": statistics.median(seconds), "best_s": min(seconds)}
        rows.append(row)
        print(f"{name:<44}{world:>6}{row['median_s']:>10.2f}{row['best_s']:>8.2f}  {'yes' if fits else 'no'}")
    write_results("plan_speed", rows, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
