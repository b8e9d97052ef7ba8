"""`ember plan` against real runs: planned vs measured per-rank memory for the small CPU layouts of
ember/plan/measure.py (fsdp=2, tensor=2, pipeline=2, Mixtral expert=2, GPT 126M fsdp=2 on 2 ranks; fsdp=4
on 4), each a torchrun job on this machine (gloo). Measured: the tensors' own bytes, and the peak of the
real training step under torch's MemTracker; planned: `make_plan(..., device="cpu")` in this process.

    python benchmarks/plan_accuracy.py
    python benchmarks/plan_accuracy.py --world 2

Prints a table and writes benchmarks/results/plan_accuracy-<device>.json. tests/plan/test_plan_accuracy.py
asserts the same: parameter, gradient and optimizer bytes equal, peaks within 10%.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from ember.plan.measure import LAYOUTS, compare, measure_layouts
from results_file import write_results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, choices=sorted(LAYOUTS), action="append",
                        help="only these world sizes (default: all)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.world or sorted(LAYOUTS):
            measured = measure_layouts(world, LAYOUTS[world], Path(tmp) / f"world{world}.json")
            for name, overrides in LAYOUTS[world].items():
                rows += [{"world": world, **row} for row in compare(world, name, overrides, measured[name])]
    mib = 2**20
    print(f"{'layout':<26}{'rank':>5}{'params+optim MiB':>18}{'grads MiB':>11}{'peak plan MiB':>15}"
          f"{'peak real MiB':>15}{'error':>8}  exact")
    for r in rows:
        exact = all(r[f"planned_{k}"] == r[f"measured_{k}"] for k in ("param_bytes", "grad_bytes", "optim_bytes"))
        print(f"{r['layout']:<26}{r['rank']:>5}{(r['planned_param_bytes'] + r['planned_optim_bytes']) / mib:>18.2f}"
              f"{r['planned_grad_bytes'] / mib:>11.2f}{r['planned_peak_bytes'] / mib:>15.1f}"
              f"{r['measured_peak_bytes'] / mib:>15.1f}{r['peak_error']:>+8.1%}  {'yes' if exact else 'NO'}")
    write_results("plan_accuracy", rows, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
