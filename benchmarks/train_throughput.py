"""Training tokens/s: ember vs transformers' LlamaForCausalLM, same config, batch, sequence and optimizer.

Both sides run a full training step (forward, loss, backward, AdamW step) on the same random batch.
ember runs its own Trainer.train_step; transformers runs `model(input_ids, labels=...)` the way its
users train. Rounds alternate between the contestants so that drift of the machine (thermal, other
load) hits both alike; the figure per contestant is the median over rounds.

    python benchmarks/train_throughput.py                 # eager and compiled, prints a table
    python benchmarks/train_throughput.py --no-compile --rounds 3 --steps 3 --vocab 8192
    python benchmarks/train_throughput.py --precision bf16   # bf16 autocast on both sides (HF: torch.autocast)
    python benchmarks/train_throughput.py --dim 512 --n-layers 8 --seq-len 512 --vocab 32000  # peers.py's 56m

The model is the debug Llama 3 (dim 256, 4 layers; --dim and --n-layers widen and deepen it) at each
vocabulary size asked for: the debug recipe's 8K, Llama 2's 32K and Llama 3's 128K. The output projection
and loss are a third of the step at 8K and most of it at 128K, so the sizes show the trunk and the head apart.

For ember's step, eager and compiled, the benchmark also prints the **floor ratio**: the step time divided
by the time of its matrix products and attention kernels alone (self time of aten::mm/addmm/bmm and SDPA's
kernels, forward and backward, from torch.profiler over five steps; a compiled step calls the same aten
kernels for them, so its figure is measured the same way), with the step time taken over the five steps
just before them, without the profiler. 1.00x would mean the step is nothing but
those kernels: the distance to this machine's limit for the same FLOPs. The largest other ops are listed
under it, so the remaining time has names.

Writes benchmarks/results/train_throughput-<device>.json (--precision bf16: train_throughput-bf16-<device>.json;
another --dim or --n-layers adds -dim<D>x<L> before the device).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from ember.models.llama.hf import hf_config_from_args
from ember.train import run as run_lib
from ember.train.trainer import Trainer
from results_file import write_results


def build_ember(overrides: list[str], compile_model: bool, out: str, precision: str) -> tuple[Trainer, Callable]:
    cfg = run_lib.load_config("debug", overrides + ["data.dataset=synthetic", "metrics.console=false",
                                                    f"output_dir={out}", f"compile={compile_model}",
                                                    f"precision={precision}"])
    trainer = Trainer(cfg)

    def step(inputs: torch.Tensor, labels: torch.Tensor) -> float:
        loss, _ = trainer.train_step([(inputs, labels)])
        return loss

    return trainer, step


def build_hf(trainer: Trainer, compile_model: bool, precision: str) -> Callable:
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(**hf_config_from_args(trainer.spec.args))
    hf_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_config).train()
    if compile_model:
        for layer in model.model.layers:
            layer.compile()
    # The same optimizer ember builds (same implementation, groups and hyper-parameters), so that the
    # comparison is of the model and loss code, not of an optimizer default.
    from ember.train.optim import build_optimizer

    optimizer = build_optimizer(model, trainer.cfg.optim, "cpu")
    max_norm = trainer.cfg.optim.max_grad_norm

    def step(inputs: torch.Tensor, labels: torch.Tensor) -> float:
        # transformers' own loss path (ForCausalLMLoss); `shift_labels` hands it targets already
        # aligned with the inputs, so both sides predict the same seq_len tokens.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):  # what ember's bf16 runs
            loss = model(input_ids=inputs, labels=labels, shift_labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


# The kernels a training step cannot do without at equal FLOPs: matrix products and attention, forward and
# backward (matmul backward is aten::mm too; the fused loss accumulates its fp32 output-matrix gradient with
# addmm_). Looked up by name: attention kernels differ between builds.
FLOOR_OPS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::_grouped_mm",
             "aten::_scaled_dot_product_flash_attention_for_cpu",
             "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
             "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_flash_attention_backward",
             "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_efficient_attention_backward",
             "aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_cudnn_attention_backward")


def kernel_floor(step: Callable, inputs: torch.Tensor, labels: torch.Tensor,
                 steps: int = 5) -> tuple[float, float, list]:
    """(seconds per step, seconds per step spent in FLOOR_OPS, the ten largest other ops as (name, seconds
    per step)). The step time is taken without the profiler (which adds its own cost between ops) over
    `steps` steps run just before the `steps` profiled ones whose kernel self times give the rest, so the
    machine's drift between the benchmark's rounds does not enter the ratio."""
    from torch.profiler import ProfilerActivity, profile

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step(inputs, labels)
    sync()
    wall = (time.perf_counter() - start) / steps
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step(inputs, labels)
    use_cuda = torch.cuda.is_available()
    floor, others = 0.0, []
    for event in prof.key_averages():
        seconds = (event.self_device_time_total if use_cuda else event.self_cpu_time_total) / 1e6 / steps
        if event.key in FLOOR_OPS:
            floor += seconds
        elif seconds > 0:
            others.append((event.key, seconds))
    others.sort(key=lambda item: -item[1])
    return wall, floor, others[:10]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per contestant per round")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--vocab", type=lambda v: [int(x) for x in v.split(",")], default=[8192, 32000, 128256],
                        help="vocabulary sizes, comma-separated")
    parser.add_argument("--dim", type=int, default=256, help="the model's width (debug flavor: 256)")
    parser.add_argument("--n-layers", type=int, default=4, help="the model's depth (debug flavor: 4)")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="both sides: fp32, or bf16 autocast (ember precision=bf16)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if min(args.rounds, args.steps, args.batch, args.seq_len, args.dim, args.n_layers, *args.vocab) < 1:
        parser.error("--rounds, --steps, --batch, --seq-len, --dim, --n-layers and --vocab must be >= 1")

    modes = [False] if args.no_compile else [False, True]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for vocab in args.vocab:
            overrides = [f"seq_len={args.seq_len}", f"global_batch_size={args.batch}",
                         f"micro_batch_size={args.batch}", f"model.vocab_size={vocab}", f"model.dim={args.dim}",
                         f"model.n_layers={args.n_layers}"]
            torch.manual_seed(0)
            inputs = torch.randint(0, vocab, (args.batch, args.seq_len))
            labels = torch.randint(0, vocab, (args.batch, args.seq_len))
            for compiled in modes:
                trainer, ember_step = build_ember(overrides, compiled, tmp, args.precision)
                contestants = {"ember": ember_step, "transformers": build_hf(trainer, compiled, args.precision)}
                for step in contestants.values():  # warm-up (and compilation) outside the timing
                    for _ in range(2):
                        step(inputs, labels)
                times: dict[str, list[float]] = {name: [] for name in contestants}
                for _ in range(args.rounds):
                    for name, step in contestants.items():
                        t0 = time.perf_counter()
                        for _ in range(args.steps):
                            step(inputs, labels)
                        times[name].append((time.perf_counter() - t0) / args.steps)
                tokens = args.batch * args.seq_len
                medians = {name: statistics.median(t) for name, t in times.items()}
                for name, t in medians.items():
                    rows.append({"contestant": name, "vocab": vocab, "compiled": compiled, "step_time_s": t,
                                 "tokens_per_s": tokens / t, "ratio_vs_transformers": medians["transformers"] / t})
                wall_s, floor_s, others = kernel_floor(ember_step, inputs, labels)
                rows[-2].update({"floor_step_s": wall_s, "floor_s": floor_s, "floor_ratio": wall_s / floor_s,
                                 "largest_other_ops_s": others})
                del trainer, contestants

    print(f"\ntrain throughput, {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; llama3 debug dim {args.dim} x {args.n_layers} layers, "
          f"batch {args.batch} x seq {args.seq_len}, {args.precision}")
    print(f"{'contestant':<14}{'vocab':>8}{'compiled':>10}{'step s':>10}{'tokens/s':>12}{'vs HF':>8}")
    for r in rows:
        print(f"{r['contestant']:<14}{r['vocab']:>8}{str(r['compiled']):>10}{r['step_time_s']:>10.4f}"
              f"{r['tokens_per_s']:>12.0f}{r['ratio_vs_transformers']:>7.2f}x")
    for r in rows:
        if "floor_ratio" in r:
            print(f"\nember {'compiled' if r['compiled'] else 'eager'}, vocab {r['vocab']}: "
                  f"floor ratio {r['floor_ratio']:.2f}x (step "
                  f"{r['floor_step_s']:.4f} s, matmul + attention kernels {r['floor_s']:.4f} s); largest other ops:")
            for name, seconds in r["largest_other_ops_s"]:
                print(f"    {name:<56}{seconds * 1e3:>8.1f} ms/step")
    if any("floor_ratio" in r for r in rows):
        print("\n(floor: the step timed without the profiler over 5 steps, then 5 more steps' kernel self times under "
              "it; the table's step is the median over rounds. The profiler adds its own cost to every op, most to "
              "the small ones: on a busy machine the listed ops can add up to more than the step.)")
    import transformers

    shape = "" if (args.dim, args.n_layers) == (256, 4) else f"-dim{args.dim}x{args.n_layers}"
    write_results("train_throughput" + ("-bf16" if args.precision == "bf16" else "") + shape, rows, args,
                  transformers=transformers.__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
