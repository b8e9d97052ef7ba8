"""Tokens/s and MFU of one recipe on one device, as `ember train` measures them, written as JSON.

The issue's GPU figure: llama3.2-1b on one GPU with torch.compile and selective remat:

    python benchmarks/single_device_mfu.py llama3.2-1b compile=true model.remat=selective \\
        global_batch_size=8 micro_batch_size=8 seq_len=2048

(on CUDA, precision=auto is bf16 and the peak comes from ember/hardware/peaks.py). Any recipe and overrides
work, e.g. `python benchmarks/single_device_mfu.py debug` on a CPU. Synthetic tokens, so the figure is
the model's and not the data pipeline's; the first `--warmup` steps (compilation, allocator growth)
are left out, and the median step of the rest is reported.

Writes benchmarks/results/single_device_mfu-<recipe>-<device>.json.

The GPU suite, one command on one H100/H200 (bf16 and FP8 for llama3.2-1b and llama3.1-8b; the 8B with 4 of
its 32 layers, as its full AdamW state, 16 bytes per parameter, does not fit one 80 GB device: the layer
shapes, the 128K vocabulary and so the MFU are the 8B's), with `ember plan`'s prediction beside each figure:

    python benchmarks/single_device_mfu.py --suite

writes benchmarks/results/single_device_mfu-suite-cuda.json.
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

from ember.metrics.run_metrics import mfu, peak_memory_gb
from ember.train import run as run_lib
from ember.train.trainer import Trainer


def measure(recipe: str, overrides: list[str], steps: int, warmup: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = run_lib.load_config(recipe, overrides + ["data.dataset=synthetic", "metrics.console=false",
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
        "dtype": str(trainer.spec.compute_dtype).replace("torch.", ""),
        "params": trainer.num_params,
        "global_batch_size": cfg.global_batch_size,
        "seq_len": cfg.seq_len,
        "step_time_s": step_time,
        "tokens_per_s": tokens_per_s,
        "tflops": tokens_per_s * trainer.spec.flops_per_token / 1e12,
        "mfu": mfu(tokens_per_s, trainer.spec.flops_per_token, trainer.peak.value_flops),
        "peak_tflops": trainer.peak.value_flops / 1e12 if trainer.peak.value_flops else None,
        "peak_source": trainer.peak.source,
        "memory_gb": peak_memory_gb(trainer.device),
        "losses": losses,
    }


SUITE = {  # name -> (recipe, overrides): one device, compiled, synthetic tokens
    "llama3.2-1b": ("llama3.2-1b", ["compile=true", "model.remat=selective", "global_batch_size=4",
                                    "micro_batch_size=4", "seq_len=2048"]),
    "llama3.1-8b (4 of 32 layers)": ("llama3.1-8b", ["compile=true", "model.remat=full", "model.n_layers=4",
                                                      "global_batch_size=2", "micro_batch_size=2", "seq_len=4096"]),
}


def planned(recipe: str, overrides: list[str]) -> dict:
    """`ember plan`'s prediction for the same recipe on one device of this kind ({} if it cannot say)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "ember", "plan", recipe, *overrides, "--world", "1", "--json"],
                          capture_output=True, text=True)
    try:
        return json.loads(proc.stdout) if proc.returncode == 0 else {}
    except ValueError:
        return {}


def suite(steps: int, warmup: int) -> None:
    rows = []
    for name, (recipe, overrides) in SUITE.items():
        for precision in ("bf16", "fp8"):
            result = measure(recipe, overrides + [f"precision={precision}"], steps, warmup)
            plan = planned(recipe, overrides + [f"precision={precision}"])
            rows.append({"model": name, "precision": precision, **result,
                         "planned_step_time_s": plan.get("step_time_s"), "planned_mfu": plan.get("mfu")})
    print(f"\n{'model':<30}{'prec':<6}{'tok/s':>10}{'MFU':>8}{'plan MFU':>10}{'step s':>9}{'plan s':>9}{'mem GB':>8}")
    for r in rows:
        fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
        print(f"{r['model']:<30}{r['precision']:<6}{r['tokens_per_s']:>10,.0f}{fmt(r['mfu'], '>8.1%')}"
              f"{fmt(r['planned_mfu'], '>10.1%')}{r['step_time_s']:>9.3f}{fmt(r['planned_step_time_s'], '>9.3f')}"
              f"{r['memory_gb']:>8.1f}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(__file__).parent / "results" / f"single_device_mfu-suite-{device}.json"
    machine = torch.cuda.get_device_name() if device == "cuda" else f"cpu ({platform.machine()})"
    out.write_text(json.dumps({"benchmark": "single_device_mfu --suite", "date": date.today().isoformat(),
                               "machine": machine, "torch": torch.__version__, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", nargs="?")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--suite", action="store_true",
                        help="bf16 and fp8 for llama3.2-1b and llama3.1-8b shapes (GPU)")
    args = parser.parse_args()
    if args.suite:
        suite(args.steps, args.warmup)
        return
    if not args.recipe:
        parser.error("name a recipe, or --suite")
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
