"""What a checkpoint costs the training loop: synchronous vs asynchronous save, side by side.

For each mode the same model trains a few steps; then, `--rounds` times: a save is started between two
steps and we time (a) how long the loop is blocked by the save call, and (b) the step right after it,
against the median plain step. Async saves block only while the state is copied to host memory; the
write overlaps the next steps.

    python benchmarks/checkpoint_cost.py                           # debug model, 8 layers x dim 512
    python benchmarks/checkpoint_cost.py model.n_layers=16

Writes benchmarks/results/checkpoint_cost-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

from ember.train import run as run_lib
from ember.train.trainer import Trainer

BASE = ["data.dataset=synthetic", "metrics.console=false", "model.n_layers=8", "model.dim=512", "model.n_heads=8",
        "model.n_kv_heads=4", "seq_len=128", "global_batch_size=4", "micro_batch_size=4"]


def measure(async_save: bool, overrides: list[str], rounds: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = run_lib.load_config("debug", BASE + overrides + [f"output_dir={tmp}",
                                                           f"checkpoint.async_save={async_save}",
                                                           "checkpoint.keep=2", "max_steps=1000"])
        trainer = Trainer(cfg)
        batches = trainer.global_batches()

        def step() -> float:
            t0 = time.perf_counter()
            trainer.train_step(next(batches))
            trainer.step += 1
            trainer.checkpointer.poll()
            return time.perf_counter() - t0

        plain = [step() for _ in range(6)][2:]
        blocked, after = [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            trainer.checkpointer.save(trainer.step, trainer.train_state())
            blocked.append(time.perf_counter() - t0)
            after.append(step())
            trainer.checkpointer.wait()
            plain += [step() for _ in range(2)]
        trainer.checkpointer.wait()
        size = sum(f.stat().st_size for f in (Path(tmp) / "checkpoints").rglob("*") if f.is_file()) / 2
        trainer.train_loader.close()
        if trainer.val_loader is not None:
            trainer.val_loader.close()
    return {"async": async_save, "params": trainer.num_params, "checkpoint_mb": size / 2**20,
            "plain_step_s": statistics.median(plain), "save_blocks_loop_s": statistics.median(blocked),
            "step_after_save_s": statistics.median(after)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows = [measure(mode, args.overrides, args.rounds) for mode in (False, True)]
    for row in rows:
        cost = row["save_blocks_loop_s"] + row["step_after_save_s"] - row["plain_step_s"]
        row["loop_cost_s"] = cost
        print(f"{'async' if row['async'] else 'sync ':5s}: {row['params']:,} params, {row['checkpoint_mb']:.0f} MB; "
              f"save blocks the loop {row['save_blocks_loop_s'] * 1e3:.0f} ms, "
              f"next step {row['step_after_save_s'] * 1e3:.0f} ms "
              f"vs {row['plain_step_s'] * 1e3:.0f} ms plain: {cost * 1e3:.0f} ms per checkpoint")
    ratio = rows[1]["loop_cost_s"] / rows[0]["loop_cost_s"] if rows[0]["loop_cost_s"] > 0 else float("nan")
    print(f"async / sync cost per checkpoint: {ratio:.2f}x")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(__file__).parent / "results" / f"checkpoint_cost-{device}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"date": date.today().isoformat(),
                               "machine": f"{platform.machine()} {os.cpu_count()} cores",
                               "torch": torch.__version__, "rows": rows, "async_over_sync": ratio}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
