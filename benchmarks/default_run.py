"""The default `ember train` run, as a newcomer runs it: the figures the README quotes come from here.

Runs `ember train` with no recipe or override but the output directory (a temporary one unless --output-dir
is given; `resume=none` so a given directory's old run is moved aside and this one starts from step 1), then
reads what the run printed and wrote:

- the first loss (step 1) and the final loss (the mean of the last logging window) from its closing
  `done: ...` line, as the run prints them;
- the validation loss, the steps, and the median tokens/s and MFU over the logging windows from
  OUTPUT_DIR/metrics.jsonl;
- the wall-clock minutes of the whole command (start-up, the tokenizer cache if it is cold, evaluation and
  the final checkpoint included).

    python benchmarks/default_run.py
    python benchmarks/default_run.py --output-dir outputs/debug      # keep the run (ember report it after)

Prints a table and writes benchmarks/results/default_run-<device>.json. Tokens/s and MFU depend on what
else the machine runs at the same time; the losses do not.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from results_file import write_results

# `done: 200 steps, loss 9.489 (step 1) -> 5.063 (mean of steps 191-200), validation loss 4.739; ...`
DONE_LINE = re.compile(r"done: (\d+) steps?, loss ([\d.]+) \(step (\d+)\) -> ([\d.]+) \(([^)]*)\)")


def run_default(output_dir: Path) -> tuple[str, float]:
    """Run `ember train output_dir=... resume=none`; its stdout and the wall-clock seconds it took."""
    command = [sys.executable, "-m", "ember", "train", f"output_dir={output_dir}", "resume=none"]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"ember train failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return done.stdout, seconds


def read_records(output_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def summarize(stdout: str, records: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """The row of the results file: losses as printed, throughput from the logging windows."""
    match = DONE_LINE.search(stdout)
    if match is None:
        raise SystemExit(f"no 'done: ...' line in the run's output:\n{stdout[-2000:]}")
    windows = [r for r in records if "tokens_per_s" in r]
    validation = [r for r in records if r.get("val_loss") is not None]
    mfus = [r["mfu"] for r in windows if r.get("mfu") is not None]
    return {
        "recipe": "debug",
        "steps": windows[-1]["step"],
        "tokens_per_step": windows[-1]["tokens_seen"] // windows[-1]["step"],
        "first_loss": float(match.group(2)),
        "first_loss_step": int(match.group(3)),
        "final_loss": float(match.group(4)),
        "final_loss_steps": match.group(5),
        "final_loss_avg_jsonl": windows[-1]["loss_avg"],
        "val_loss": validation[-1]["val_loss"] if validation else None,
        "wall_minutes": seconds / 60,
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in windows),
        "mfu_median": statistics.median(mfus) if mfus else None,
        "mfu_min": min(mfus) if mfus else None,
        "mfu_max": max(mfus) if mfus else None,
        "done_line": match.group(0),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="the run's output_dir (default: a temporary directory, removed afterwards)")
    parser.add_argument("--notes", default="", help="a note stored with the results (e.g. what else the machine ran)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        output_dir = (args.output_dir or Path(scratch) / "debug").resolve()
        stdout, seconds = run_default(output_dir)
        row = summarize(stdout, read_records(output_dir), seconds)
    print(f"\ndefault run ({row['steps']} steps of {row['tokens_per_step']} tokens): {row['done_line']}")
    print(f"{'first loss':>12}{'final loss':>12}{'val loss':>10}{'minutes':>9}{'tokens/s':>10}{'MFU':>8}")
    mfu = f"{row['mfu_median']:.1%}" if row["mfu_median"] is not None else "-"
    val = f"{row['val_loss']:.3f}" if row["val_loss"] is not None else "-"
    print(f"{row['first_loss']:>12.3f}{row['final_loss']:>12.3f}{val:>10}{row['wall_minutes']:>9.2f}"
          f"{row['tokens_per_s_median']:>10,.0f}{mfu:>8}")
    args.output_dir = str(args.output_dir) if args.output_dir else None
    write_results("default_run", [row], args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
