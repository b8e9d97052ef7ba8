"""Parallel layouts side by side: tokens/s, peak memory and parameter+optimizer memory per rank.

Each layout runs as its own torchrun job of the debug-size Llama 3 (7.1M parameters, seq 256) on
synthetic tokens, with the same global batch; the worker times `steps` optimizer steps after `warmup`,
and measures per rank the bytes of its local parameter shards plus AdamW state (exp_avg, exp_avg_sq):
what FSDP divides by the fsdp degree.

    python benchmarks/parallel_scaling.py                       # 1, 2 and 4 processes, every layout
    python benchmarks/parallel_scaling.py --nproc 1 2 --steps 5

Writes benchmarks/results/parallel_scaling-<device>.json. On a CPU machine with fewer cores than
processes the ranks share cores: tokens/s then shows the cost of the layout's communication and
oversubscription, not its speed on real hardware; the memory columns hold anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

# micro_batch_size = global batch / data-parallel degree: one micro-batch per rank and step everywhere.
LAYOUTS = {
    1: {"single process": ["micro_batch_size=8"]},
    2: {
        "fsdp=2": ["ici_mesh.fsdp=2", "micro_batch_size=4"],
        "data=2": ["ici_mesh.data=2", "ici_mesh.fsdp=1", "micro_batch_size=4"],
        "tensor=2": ["ici_mesh.tensor=2", "ici_mesh.fsdp=1", "micro_batch_size=8"],
        "pipeline=2 (1f1b)": ["ici_mesh.pipeline=2", "ici_mesh.fsdp=1", "micro_batch_size=8"],
        "context=2": ["ici_mesh.context=2", "ici_mesh.fsdp=1", "micro_batch_size=8"],
    },
    4: {
        "fsdp=4": ["ici_mesh.fsdp=4", "micro_batch_size=2"],
        "data=2 x fsdp=2": ["ici_mesh.data=2", "ici_mesh.fsdp=2", "micro_batch_size=2"],
        "fsdp=2 x tensor=2": ["ici_mesh.fsdp=2", "ici_mesh.tensor=2", "micro_batch_size=4"],
        "pipeline=2 x fsdp=2": ["ici_mesh.pipeline=2", "ici_mesh.fsdp=2", "micro_batch_size=4"],
        "context=2 x fsdp=2": ["ici_mesh.context=2", "ici_mesh.fsdp=2", "micro_batch_size=4"],
    },
}
BASE = ["data.dataset=synthetic", "metrics.console=false", "global_batch_size=8", "seq_len=256"]


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def worker(out_path: str, steps: int, warmup: int, overrides: list[str]) -> None:
    """One rank of one layout: train, time, measure; rank 0 writes the figures of every rank."""
    import torch
    import torch.distributed as dist

    from ember.metrics.run_metrics import peak_memory_gb
    from ember.train import run as run_lib
    from ember.train.trainer import Trainer

    world = int(os.environ.get("WORLD_SIZE", 1))
    with tempfile.TemporaryDirectory() as tmp:
        cfg = run_lib.load_config("debug", BASE + overrides + [f"output_dir={tmp}"], world_size=world)
        trainer = Trainer(cfg)
        batches = trainer.global_batches()
        times = []
        for i in range(warmup + steps):
            micro_batches = next(batches)
            if dist.is_initialized():
                dist.barrier()
            t0 = time.perf_counter()
            trainer.train_step(micro_batches)
            times.append(time.perf_counter() - t0)
        params = list(trainer.model.parameters())
        state = [v for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
        figures = torch.tensor([_local_bytes(params), _local_bytes(state), peak_memory_gb(trainer.device)],
                               dtype=torch.float64)
        everyone = [torch.zeros_like(figures) for _ in range(world)]
        if dist.is_initialized():
            dist.all_gather(everyone, figures)
        else:
            everyone = [figures]
        step_time = statistics.median(times[warmup:])
        for loader in (trainer.train_loader, trainer.val_loader):
            if loader is not None:
                loader.close()
    if int(os.environ.get("RANK", 0)) == 0:
        tokens = cfg.global_batch_size * cfg.seq_len
        result = {
            "world_size": world,
            "step_time_s": step_time,
            "tokens_per_s": tokens / step_time,
            "param_bytes_per_rank": [int(f[0]) for f in everyone],
            "optimizer_bytes_per_rank": [int(f[1]) for f in everyone],
            "peak_rss_gb_per_rank": [float(f[2]) for f in everyone],
        }
        Path(out_path).write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


def run_layout(nproc: int, overrides: list[str], steps: int, warmup: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        worker_args = [__file__, "--worker", str(out), "--steps", str(steps), "--warmup", str(warmup), "--", *overrides]
        # Each process gets an equal share of the cores, so 1, 2 and 4 processes use the same machine.
        threads = max(1, (os.cpu_count() or 1) // nproc)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore")
        if nproc == 1:
            cmd = [sys.executable, *worker_args]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   *worker_args]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"layout {overrides} on {nproc} processes failed:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2, 4], choices=sorted(LAYOUTS))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.warmup, args.overrides)
        return

    import torch

    rows = []
    baseline = None
    for nproc in args.nproc:
        for name, overrides in LAYOUTS[nproc].items():
            result = run_layout(nproc, overrides, args.steps, args.warmup)
            state = [p + o for p, o in zip(result["param_bytes_per_rank"], result["optimizer_bytes_per_rank"])]
            result.update(layout=name, nproc=nproc, overrides=overrides, param_optim_mib_max=max(state) / 2**20)
            if baseline is None and nproc == 1:
                baseline = result
            rows.append(result)
            print(f"{name:24s} {nproc} proc  {result['tokens_per_s']:8.0f} tok/s  "
                  f"params+optim {result['param_optim_mib_max']:7.2f} MiB/rank  "
                  f"peak RSS {max(result['peak_rss_gb_per_rank']):.2f} GB/rank", flush=True)
    if baseline is not None:
        for row in rows:
            row["param_optim_vs_single"] = row["param_optim_mib_max"] / baseline["param_optim_mib_max"]
            row["tokens_per_s_vs_single"] = row["tokens_per_s"] / baseline["tokens_per_s"]

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"ember parallel layouts, debug model, global batch 8 x 256 ({platform.machine()}, "
                        f"{os.cpu_count()} cores)")
    for column in ("layout", "procs", "tokens/s", "vs 1 proc", "params+optim MiB/rank", "vs 1 proc",
                   "peak RSS GB/rank"):
        table.add_column(column, justify="left" if column == "layout" else "right")
    for row in rows:
        table.add_row(row["layout"], str(row["nproc"]), f"{row['tokens_per_s']:,.0f}",
                      f"{row.get('tokens_per_s_vs_single', float('nan')):.2f}x", f"{row['param_optim_mib_max']:.2f}",
                      f"{row.get('param_optim_vs_single', float('nan')):.3f}x",
                      f"{max(row['peak_rss_gb_per_rank']):.2f}")
    console = Console()
    console.width = max(console.width, 120)
    console.print(table)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(__file__).parent / "results" / f"parallel_scaling-{device}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({
        "date": date.today().isoformat(), "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "torch": torch.__version__, "steps": args.steps, "warmup": args.warmup, "rows": rows,
    }, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
