"""Training tokens/s of a debug MoE (Mixtral's, Qwen3-MoE's with `--model qwen3_moe`, DeepSeek-V3's with `--model
deepseek_v3`): ember with its grouped and its looped expert path vs transformers' own class (MixtralForCausalLM,
Qwen3MoeForCausalLM, DeepseekV3ForCausalLM), same config, weights, batch, sequence and optimizer.

Every contestant runs a full training step (forward, loss, backward, clip, AdamW step) on the same random
batch. ember runs its Trainer.train_step with every MoE layer's `experts.impl` forced to "grouped"
(F.grouped_mm over all experts) or "looped" (one matmul per expert); both share one model and optimizer.
transformers runs `model(input_ids, labels=...)` the way its users train, with the experts
implementation it picks by default (recorded in the JSON; `--hf-experts` picks another). It starts from
ember's weights (exported with ember's HF writer), so routing, and with it each expert's load, is the
same, and the two first-step losses must agree: the check that the configs are the same.
Rounds alternate between the contestants so that drift of the machine hits all alike; the figure per
contestant is the median over rounds. CPU: fp32. CUDA: bf16 autocast on both sides (ember's default
single-GPU precision), where ember's grouped path is the grouped GEMM kernel.

    python benchmarks/moe_throughput.py                      # 5 rounds of 4 steps, prints a table
    python benchmarks/moe_throughput.py --model qwen3_moe    # Qwen3-MoE's debug flavor (16 experts, top 4)
    python benchmarks/moe_throughput.py --model deepseek_v3  # DeepSeek-V3's (MLA, 16 experts in 4 groups, top 4,
                                                             # a shared expert, a dense first layer)
    python benchmarks/moe_throughput.py --quick              # 2 rounds of 1 step: checks that it runs; noise
    python benchmarks/moe_throughput.py --model qwen3_moe --override model.dim=1024 model.n_experts=64 \
        model.moe_hidden_dim=512 --name wide                 # a wider model, where a GPU's time is in its kernels

Writes benchmarks/results/moe_throughput-<cpu|cuda>.json for Mixtral, moe_throughput-<model>-<cpu|cuda>.json
for the others (with --quick: ...-quick.json, so that a smoke run never replaces a measurement).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Callable

import torch

from ember.model_io.convert import save_hf
from ember.train import run as run_lib
from ember.train.optim import build_optimizer
from ember.train.trainer import Trainer

Step = Callable[[torch.Tensor, torch.Tensor], float]


def build_ember(family: str, overrides: list[str], out: str) -> Trainer:
    # Auxiliary losses off on both sides: transformers adds its load-balancing loss only with
    # output_router_logits=True (off in the exported config) and has no z-loss, so ember's coefficients
    # are zeroed to train on the language-model loss alone (its MoE layers still compute the two scalars).
    cfg = run_lib.load_config("debug", overrides + [
        f"model.family={family}", "model.flavor=debug", "model.aux_loss_coef=0", "model.z_loss_coef=0",
        "data.dataset=synthetic", "metrics.console=false", f"output_dir={out}", "compile=false",
    ])
    return Trainer(cfg)


def ember_step(trainer: Trainer, impl: str) -> Step:
    def step(inputs: torch.Tensor, labels: torch.Tensor) -> float:
        for moe in trainer.model.moe_layers():
            moe.experts.force_impl(impl)
        loss, _ = trainer.train_step([(inputs, labels)])
        return loss

    return step


def build_hf(trainer: Trainer, experts_impl: str | None, tmp: Path) -> tuple[torch.nn.Module, Step]:
    from transformers import AutoModelForCausalLM

    # ember's weights through ember's HF export (per-expert hub layout, q/k permuted for HF's RoPE), read
    # back by transformers: same weights, so the same routing and expert loads on both sides.
    save_hf(copy.deepcopy(trainer.model).cpu(), trainer.spec.args, tmp / "hf")
    kwargs = {"experts_implementation": experts_impl} if experts_impl else {}
    model = AutoModelForCausalLM.from_pretrained(tmp / "hf", dtype=torch.float32, attn_implementation="sdpa", **kwargs)
    model = model.to(trainer.device).train()
    cfg, args = model.config, trainer.spec.args
    # The same MoE as ember's: experts, top-k, expert width, no router jitter, no auxiliary loss.
    expert_width = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    assert (cfg.num_local_experts, cfg.num_experts_per_tok) == (args.n_experts, args.top_k)
    assert expert_width == (getattr(args, "moe_hidden_dim", None) or args.ffn_hidden_dim)
    assert getattr(cfg, "router_jitter_noise", 0.0) == 0.0 and not cfg.output_router_logits
    # The same optimizer ember builds (implementation, groups and hyper-parameters), so that the comparison
    # is of the model code, not of an optimizer default.
    optimizer = build_optimizer(model, trainer.cfg.optim, trainer.device.type)
    max_norm = trainer.cfg.optim.max_grad_norm
    autocast = (torch.autocast(trainer.device.type, dtype=trainer.spec.compute_dtype)
                if trainer.spec.compute_dtype != torch.float32 else contextlib.nullcontext())

    def step(inputs: torch.Tensor, labels: torch.Tensor) -> float:
        with autocast:
            # transformers' own loss path; `shift_labels` hands it targets already aligned with the
            # inputs, so both sides predict the same seq_len tokens. No KV cache in training.
            loss = model(input_ids=inputs, labels=labels, shift_labels=labels, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return model, step


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, {os.cpu_count()} CPU cores"
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():  # Linux: the model name says more than the architecture
        lines = cpuinfo.read_text().splitlines()
        cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), cpu)
    return f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mixtral", choices=["mixtral", "qwen3_moe", "deepseek_v3"],
                        help="the family whose debug flavor runs (default: mixtral)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per contestant per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per contestant before the rounds")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 1 step, 1 warm-up: a smoke run")
    parser.add_argument("--hf-experts", default=None, choices=["eager", "grouped_mm", "batched_mm"],
                        help="transformers' experts implementation (default: the one it picks itself)")
    parser.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE",
                        help="ember config overrides of the debug flavor (e.g. model.dim=1024 model.n_experts=64), "
                             "exported to transformers' config alike")
    parser.add_argument("--name", default="", help="a suffix for the JSON's name, for a run with --override")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if args.override and not args.name:
        parser.error("--override changes the model: name its results with --name "
                     "(the JSON would replace the debug one)")
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 1, 1

    overrides = [f"seq_len={args.seq_len}", f"global_batch_size={args.batch}", f"micro_batch_size={args.batch}",
                 *args.override]
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_ember(args.model, overrides, tmp)
        device, margs = trainer.device, trainer.spec.args
        torch.manual_seed(0)
        inputs = torch.randint(0, margs.vocab_size, (args.batch, args.seq_len), device=device)
        labels = torch.randint(0, margs.vocab_size, (args.batch, args.seq_len), device=device)
        hf_model, hf_step = build_hf(trainer, args.hf_experts, Path(tmp))
        hf_experts = hf_model.config._experts_implementation
        # Same weights, same batch: the first steps' losses (before any update) must agree.
        first_loss = {"ember": ember_step(trainer, "grouped")(inputs, labels), "transformers": hf_step(inputs, labels)}
        print(f"first-step loss: ember {first_loss['ember']:.5f}, transformers {first_loss['transformers']:.5f}")
        if abs(first_loss["ember"] - first_loss["transformers"]) > 1e-2 * abs(first_loss["transformers"]):
            print("warning: the first-step losses differ: the two models are not the same", file=sys.stderr)

        contestants: dict[str, Step] = {
            "ember grouped": ember_step(trainer, "grouped"),
            "ember looped": ember_step(trainer, "looped"),
            "transformers": hf_step,
        }
        for step in contestants.values():  # warm-up outside the timing
            for _ in range(args.warmup):
                step(inputs, labels)
        times: dict[str, list[float]] = {name: [] for name in contestants}
        for _ in range(args.rounds):
            for name, step in contestants.items():
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    step(inputs, labels)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times[name].append((time.perf_counter() - t0) / args.steps)

    tokens = args.batch * args.seq_len
    medians = {name: statistics.median(t) for name, t in times.items()}
    paths = {"ember grouped": "grouped_mm", "ember looped": "per-expert loop", "transformers": hf_experts}
    rows = [{"contestant": name, "experts": paths[name], "step_time_s": t, "tokens_per_s": tokens / t,
             "ratio_vs_transformers": medians["transformers"] / t, "round_times_s": times[name]}
            for name, t in medians.items()]
    ratios = {
        "ember_grouped_vs_transformers": medians["transformers"] / medians["ember grouped"],
        "ember_looped_vs_transformers": medians["transformers"] / medians["ember looped"],
        "grouped_vs_looped": medians["ember looped"] / medians["ember grouped"],
    }
    precision = ("fp32" if trainer.spec.compute_dtype == torch.float32
                 else f"{str(trainer.spec.compute_dtype)[6:]} autocast")
    expert_width = getattr(margs, "moe_hidden_dim", None) or margs.ffn_hidden_dim
    config = {
        "model": f"{args.model} debug", "dim": margs.dim, "n_layers": margs.n_layers, "n_heads": margs.n_heads,
        "n_kv_heads": margs.kv_heads, "n_experts": margs.n_experts, "top_k": margs.top_k,
        "expert_hidden_dim": expert_width, "vocab_size": margs.vocab_size, "batch": args.batch,
        "seq_len": args.seq_len, "precision": precision, "aux_losses": "off on both sides",
        "optimizer": {"name": trainer.cfg.optim.name, "implementation": trainer.cfg.optim.implementation,
                      "fused": bool(trainer.optimizer.defaults.get("fused")), "lr": trainer.cfg.optim.lr,
                      "max_grad_norm": trainer.cfg.optim.max_grad_norm},
        "transformers_experts_implementation": hf_experts,
        "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup, "quick": args.quick,
        "overrides": args.override,
    }

    print(f"\nMoE train throughput, {machine(device)}, torch {torch.__version__}; {args.model} debug "
          f"(dim {margs.dim}, {margs.n_layers} layers, {margs.n_experts} experts top-{margs.top_k}, vocab "
          f"{margs.vocab_size}), batch {args.batch} x seq {args.seq_len}, {precision}"
          + (" -- quick run: noise, not a measurement" if args.quick else ""))
    print(f"{'contestant':<16}{'experts':<18}{'step s':>10}{'tokens/s':>12}{'vs HF':>8}")
    for r in rows:
        print(f"{r['contestant']:<16}{r['experts']:<18}{r['step_time_s']:>10.4f}{r['tokens_per_s']:>12.0f}"
              f"{r['ratio_vs_transformers']:>7.2f}x")
    print("ratios: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    import transformers

    result = {
        "benchmark": "moe_throughput",
        "date": date.today().isoformat(),
        "machine": machine(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "config": config,
        "first_step_loss": first_loss,
        "rows": rows,
        "ratios": ratios,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    model = "" if args.model == "mixtral" else f"{args.model}-"
    name = f"-{args.name}" if args.name else ""
    path = args.out / f"moe_throughput-{model}{device.type}{name}{'-quick' if args.quick else ''}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
