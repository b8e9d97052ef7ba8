"""Whether precision=auto picks the faster dtype on this CPU: the default run trained side by side in fp32, in bf16
autocast and under precision=auto, in alternating rounds (so a slow spell of the machine hits all three alike).

For each round and precision it runs `ember train debug max_steps=STEPS precision=P` in a fresh output
directory and takes the median tokens/s of the logging windows after the first (start-up and warm-up excluded),
and reads what auto chose from the run's header (the `precision: auto -> ...` line, with the two matmul rates
that decided). The verdict: auto's dtype is the one whose median over the rounds is higher (or within
--tie of it, where either choice costs nothing).

    python benchmarks/precision_auto.py                   # 2 rounds of 60 steps each
    python benchmarks/precision_auto.py --rounds 3 --steps 100
    python benchmarks/precision_auto.py --isa AVX512_CORE_BF16    # an AMX CPU run as an AVX512-BF16 one without AMX

Prints a table and writes benchmarks/results/precision_auto-<bf16 kind>-cpu.json, the kind naming the CPU's
bf16 matmul instructions (amx, avx512-bf16, arm-bf16 or none; with --isa, the cap), so results from different
CPUs sit side by side. --isa caps the instructions oneDNN uses (ONEDNN_MAX_CPU_ISA) for every run, auto's own
measurement included (its cache key names the cap).
Run it on a quiet machine: the ratio, not the absolute rate, is what it measures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from results_file import write_results

PRECISIONS = ("fp32", "bf16", "auto")
AUTO_LINE = re.compile(r"^precision: auto -> (\S+).*$", re.MULTILINE)


def bf16_kind() -> str:
    """The CPU's bf16 matmul instructions, as torch detects them (not EMBER_CPU_BF16)."""
    found = getattr(torch.cpu, "get_capabilities", lambda: {})()
    for flag, name in (("amx_bf16", "amx"), ("avx512_bf16", "avx512-bf16"), ("bf16", "arm-bf16")):
        if found.get(flag):
            return name
    return "none"


def train(precision: str, steps: int, out: Path, env: dict[str, str]) -> tuple[float, str, str]:
    """One run: its median tokens/s after the first logging window, its compute dtype, and auto's header line."""
    command = [sys.executable, "-m", "ember", "train", "debug", f"max_steps={steps}", "logging_steps=10",
               f"precision={precision}", f"output_dir={out}", "resume=none", "eval_interval=0", "eval_batches=1"]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"ember train precision={precision} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    windows = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][1:]
    compute = json.loads((out / "run.json").read_text())["compute"]
    match = AUTO_LINE.search(done.stdout)
    return statistics.median(windows), compute, match.group(0) if match else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of the three runs (default 2)")
    parser.add_argument("--steps", type=int, default=60, help="steps per run, >= 30 (default 60)")
    parser.add_argument("--tie", type=float, default=0.05,
                        help="auto's dtype within this fraction of the faster one counts as the faster (default 0.05)")
    parser.add_argument("--isa", default=None, help="ONEDNN_MAX_CPU_ISA for every run, e.g. AVX512_CORE_BF16 "
                        "(default: none, the CPU's own)")
    parser.add_argument("--notes", default="", help="free text kept in the results (the machine's state)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results",
                        help="results folder (default: benchmarks/results)")
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 30:
        parser.error("--rounds must be >= 1 and --steps >= 30 (three logging windows at least)")
    env = dict(os.environ, **({"ONEDNN_MAX_CPU_ISA": args.isa} if args.isa else {}))
    env.pop("EMBER_CPU_BF16", None)  # auto's own detection and measurement, not a declaration
    kind = f"isa-{args.isa.lower().replace('_', '-')}" if args.isa else bf16_kind()
    rates: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    auto_compute, auto_line = "", ""
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            for precision in PRECISIONS:
                rate, compute, line = train(precision, args.steps, Path(tmp) / f"{precision}-{round_index}", env)
                rates[precision].append(rate)
                if precision == "auto":
                    auto_compute, auto_line = compute, line
                print(f"round {round_index + 1} {precision:>4}: {rate:,.0f} tokens/s ({compute})", flush=True)
    median = {p: statistics.median(r) for p, r in rates.items()}
    auto_dtype = "bf16" if auto_compute == "bfloat16" else "fp32"
    faster = max(("fp32", "bf16"), key=lambda p: median[p])
    picked_faster = median[auto_dtype] >= (1 - args.tie) * median[faster]
    row: dict[str, Any] = {"cpu_bf16": bf16_kind(), "isa": args.isa, "steps": args.steps, "rounds": args.rounds,
                           **{f"tokens_per_s_{p}": median[p] for p in PRECISIONS},
                           **{f"tokens_per_s_{p}_rounds": rates[p] for p in PRECISIONS},
                           "bf16_over_fp32": median["bf16"] / median["fp32"], "auto_chose": auto_dtype,
                           "faster": faster, "auto_picked_the_faster": picked_faster, "auto_header": auto_line}
    print(f"\n{'precision':<10}{'tokens/s (median)':>20}")
    for p in PRECISIONS:
        print(f"{p:<10}{median[p]:>20,.0f}")
    print(f"bf16 / fp32: {row['bf16_over_fp32']:.2f}x; auto chose {auto_dtype}, the faster is {faster}: "
          f"{'OK' if picked_faster else 'WRONG'}\n{auto_line}")
    write_results(f"precision_auto-{kind}", [row], args)
    if not picked_faster:
        sys.exit(1)


if __name__ == "__main__":
    main()
