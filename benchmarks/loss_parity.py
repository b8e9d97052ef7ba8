"""Losses of a few short runs of every family and layout, to compare two commits bit for bit.

A refactor that must change no number runs this before and after and compares:

    python benchmarks/loss_parity.py --out /tmp/before.json            # on the old commit
    python benchmarks/loss_parity.py --out /tmp/after.json --compare /tmp/before.json

Each case is `ember train` on synthetic tokens with a metrics record every step (logging_steps=1): the
per-step losses and gradient norms are written as floats' reprs, so equality means bit-identical. Exits 1
and names the first differing case and step when --compare finds a difference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

STEPS = 4
COMMON = [f"max_steps={STEPS}", "logging_steps=1", "data.dataset=synthetic", "seq_len=64", "global_batch_size=4",
          "micro_batch_size=2", "metrics.console=false", "checkpoint.interval=0", "eval_interval=0",
          "metrics.peak_tflops=1"]

# (name, processes, overrides): the four families on one process, then the layouts that route through the
# distributed build (FSDP, TP with loss_parallel, EP, pipeline, MoE under TP).
CASES: list[tuple[str, int, list[str]]] = [
    ("llama3", 1, ["model.family=llama3", "model.flavor=debug"]),
    ("mixtral", 1, ["model.family=mixtral", "model.flavor=debug", "model.aux_loss_coef=0.01",
                    "model.z_loss_coef=0.001"]),
    ("glam", 1, ["model.family=glam", "model.flavor=debug"]),
    ("gpt", 1, ["model.family=gpt", "model.flavor=debug"]),
    ("llama3-fsdp2", 2, ["model.family=llama3", "model.flavor=debug"]),
    ("llama3-tensor2", 2, ["model.family=llama3", "model.flavor=debug", "ici_mesh.fsdp=1", "ici_mesh.tensor=2"]),
    ("mixtral-expert2", 2, ["model.family=mixtral", "model.flavor=debug", "ici_mesh.expert=2"]),
    ("llama3-pipeline2", 2, ["model.family=llama3", "model.flavor=debug", "ici_mesh.fsdp=1", "ici_mesh.pipeline=2"]),
    ("mixtral-tensor2", 2, ["model.family=mixtral", "model.flavor=debug", "ici_mesh.fsdp=1", "ici_mesh.tensor=2"]),
]


def run_case(processes: int, overrides: list[str], out_dir: Path) -> list[dict]:
    launch = ["ember", "train"] if processes == 1 else ["ember", "launch", "local", "--nproc-per-node", str(processes)]
    cmd = [*launch, "debug", *COMMON, *overrides, f"output_dir={out_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [{"step": r["step"], "loss": repr(r["loss"]), "grad_norm": repr(r.get("grad_norm"))}
            for r in records if "loss" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="where to write the losses (JSON)")
    parser.add_argument("--compare", type=Path, help="a file this script wrote before: exit 1 on any difference")
    parser.add_argument("--cases", nargs="*", help="only these cases (default: all)")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, processes, overrides in CASES:
            if args.cases and name not in args.cases:
                continue
            results[name] = run_case(processes, overrides, Path(tmp) / name)
            print(f"{name:18s} losses {[float(r['loss']) for r in results[name]]}", flush=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    if args.compare:
        reference = json.loads(args.compare.read_text())
        for name, rows in results.items():
            if rows != reference.get(name):
                print(f"DIFFERENT: {name}\n  now    {rows}\n  before {reference.get(name)}")
                sys.exit(1)
        print(f"bit-identical: {len(results)} cases x {STEPS} steps (loss and grad norm) match {args.compare}")


if __name__ == "__main__":
    main()
