"""Tokens/s and MFU of one recipe on one device, as `ember train` measures them, written as JSON.

The issue's GPU figure: llama3.2-1b on one GPU with torch.compile and selective remat:

    python benchmarks/single_device_mfu.py llama3.2-1b compile=true model.remat=selective \\
        global_batch_size=8 micro_batch_size=8 seq_len=2048

(on CUDA, precision=auto is bf16 and the peak comes from ember/hardware.py). Any recipe and overrides
work, e.g. `python benchmarks/single_device_mfu.py debug` on a CPU. Synthetic tokens, so the figure is
the model's and not the data pipeline's; the first `--warmup` steps (compilation, allocator growth)
are left out, and the median step of the rest is reported.

Writes benchmarks/results/single_device_mfu-<recipe>-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

from ember import config as config_lib
from ember.metrics import mfu, peak_memory_gb
from ember.train import Trainer


def measure(recipe: str, overrides: list[str], steps: int, warmup: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config_lib.load(recipe, overrides + ["data.dataset=synthetic", "metrics.console=false",
                                                   f"output_dir={tmp}", f"max_steps={steps + warmup}"])
        trainer = Trainer(cfg)
        batches = trainer.global_batches()
        times, losses = [], []
        for _ in range(warmup + steps):
            micro_batches = next(batches)
            t0 = time.perf_counter()
            loss, _ = trainer.train_step(micro_batches)  # returns floats: the step is complete
            if trainer.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            losses.append(loss)
        trainer.train_loader.close()
        if trainer.val_loader is not None:
            trainer.val_loader.close()
    step_time = statistics.median(times[warmup:])
    tokens_per_s = cfg.global_batch_size * cfg.seq_len / step_time
    return {
        "recipe": recipe,
        "overrides": overrides,
        "device": torch.cuda.get_device_name() if trainer.device.type == "cuda" else f"cpu ({platform.machine()})",
        "dtype": str(trainer.compute_dtype).replace("torch.", ""),
        "params": trainer.num_params,
        "global_batch_size": cfg.global_batch_size,
        "seq_len": cfg.seq_len,
        "step_time_s": step_time,
        "tokens_per_s": tokens_per_s,
        "tflops": tokens_per_s * trainer.flops_per_token / 1e12,
        "mfu": mfu(tokens_per_s, trainer.flops_per_token, trainer.peak.value_flops),
        "peak_tflops": trainer.peak.value_flops / 1e12 if trainer.peak.value_flops else None,
        "peak_source": trainer.peak_source,
        "memory_gb": peak_memory_gb(trainer.device),
        "losses": losses,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    result = measure(args.recipe, args.overrides, args.steps, args.warmup)
    result.update(date=date.today().isoformat(), torch=torch.__version__)
    mfu_text = f"{result['mfu']:.1%}" if result["mfu"] is not None else "n/a (unknown peak)"
    print(f"{args.recipe} {' '.join(args.overrides)} on {result['device']} ({result['dtype']}): "
          f"{result['tokens_per_s']:,.0f} tokens/s, {result['tflops']:.2f} TFLOP/s, MFU {mfu_text}, "
          f"{result['memory_gb']:.2f} GB peak")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(__file__).parent / "results" / f"single_device_mfu-{args.recipe}-{device}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
