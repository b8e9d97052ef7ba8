"""What a checkpoint costs the training loop: synchronous vs asynchronous save, side by side.

For each mode the same model trains a few steps; then, `--rounds` times: a save is started between two
steps and we time (a) how long the loop is blocked by the save call, and (b) the step right after it,
against the median plain step. Async saves block only while the state is copied to host memory; the
write overlaps the next steps.

    python benchmarks/checkpoint_cost.py                           # debug model, 8 layers x dim 512
    python benchmarks/checkpoint_cost.py model.n_layers=16
    python benchmarks/checkpoint_cost.py --output-dir s3://bucket/bench   # the local disk and the store, side by side

Writes benchmarks/results/checkpoint_cost-<device>.json (with --output-dir: checkpoint_cost-<device>-store.json,
which adds each save's and load's throughput in MB/s on the local disk and on the store). The store's credentials
and endpoint come from the environment (AWS_ENDPOINT_URL for an S3-compatible server).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
import uuid
from datetime import date
from pathlib import Path
from typing import Optional

import torch

from ember.checkpoint.run_dir import complete_checkpoints
from ember.storage.location import as_path, remove_tree
from ember.train import run as run_lib
from ember.train.trainer import Trainer

BASE = ["data.dataset=synthetic", "metrics.console=false", "model.n_layers=8", "model.dim=512", "model.n_heads=8",
        "model.n_kv_heads=4", "seq_len=128", "global_batch_size=4", "micro_batch_size=4"]


def measure(async_save: bool, overrides: list[str], rounds: int, store: Optional[str] = None) -> dict:
    """One mode's costs, its run on the local disk, or under `store` (a URL) when given."""
    with tempfile.TemporaryDirectory() as tmp:
        output_dir = f"{store.rstrip('/')}/{uuid.uuid4().hex[:8]}" if store else tmp
        cfg = run_lib.load_config("debug", BASE + overrides + [f"output_dir={output_dir}",
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
        newest = complete_checkpoints(trainer.checkpointer.dir)[-1][1]
        size = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())
        loads = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            trainer.checkpointer.load(newest)
            loads.append(time.perf_counter() - t0)
        trainer.train_loader.close()
        if trainer.val_loader is not None:
            trainer.val_loader.close()
        if store:
            remove_tree(as_path(output_dir))
    mb = size / 2**20
    return {"where": "store" if store else "local disk", "async": async_save, "params": trainer.num_params,
            "checkpoint_mb": mb, "plain_step_s": statistics.median(plain),
            "save_blocks_loop_s": statistics.median(blocked), "step_after_save_s": statistics.median(after),
            "load_s": statistics.median(loads), "load_mb_per_s": mb / statistics.median(loads),
            **({} if async_save else {"save_mb_per_s": mb / statistics.median(blocked)})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-dir", help="a URL (s3://bucket/prefix, gs://...) to measure beside the local disk")
    args = parser.parse_args()
    stores = [None, args.output_dir] if args.output_dir else [None]
    rows = [measure(mode, args.overrides, args.rounds, store) for store in stores for mode in (False, True)]
    for row in rows:
        cost = row["save_blocks_loop_s"] + row["step_after_save_s"] - row["plain_step_s"]
        row["loop_cost_s"] = cost
        rate = f"; save {row['save_mb_per_s']:.0f} MB/s" if "save_mb_per_s" in row else ""
        print(f"{row['where']:10s} {'async' if row['async'] else 'sync ':5s}: {row['params']:,} params, "
              f"{row['checkpoint_mb']:.0f} MB; save blocks the loop {row['save_blocks_loop_s'] * 1e3:.0f} ms, "
              f"next step {row['step_after_save_s'] * 1e3:.0f} ms vs {row['plain_step_s'] * 1e3:.0f} ms plain: "
              f"{cost * 1e3:.0f} ms per checkpoint{rate}; load {row['load_s'] * 1e3:.0f} ms "
              f"({row['load_mb_per_s']:.0f} MB/s)")
    ratio = rows[1]["loop_cost_s"] / rows[0]["loop_cost_s"] if rows[0]["loop_cost_s"] > 0 else float("nan")
    print(f"async / sync cost per checkpoint (local disk): {ratio:.2f}x")
    extra = {}
    if args.output_dir:
        local_sync, store_sync = rows[0], rows[2]
        extra = {"store_over_local_save_time": store_sync["save_blocks_loop_s"] / local_sync["save_blocks_loop_s"],
                 "store_over_local_load_time": store_sync["load_s"] / local_sync["load_s"]}
        print(f"store / local disk: save {extra['store_over_local_save_time']:.2f}x the time, "
              f"load {extra['store_over_local_load_time']:.2f}x")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(__file__).parent / "results" / f"checkpoint_cost-{device}{'-store' if args.output_dir else ''}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"date": date.today().isoformat(),
                               "machine": f"{platform.machine()} {os.cpu_count()} cores",
                               "torch": torch.__version__, "store": args.output_dir, "rows": rows,
                               "async_over_sync": ratio, **extra}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
