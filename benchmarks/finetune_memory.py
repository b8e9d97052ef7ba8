"""Fine-tuning memory and speed: full fine-tuning vs LoRA in ember, and ember's LoRA vs transformers + peft.

For the debug Llama (7M) and a ~110M Llama, from the same base weights (an HF directory both sides load), on
the same random batch and optimizer (ember's AdamW settings), each contestant runs in a fresh process:
- ember full fine-tuning (`model.init_from=BASE`) at precision=auto (fp32 on a CPU) and precision=bf16, and
  ember LoRA at rank 8 and 32 on every linear of attention and MLP (`lora.rank=R lora.targets=all`) at
  precision=auto: bf16 compute with the frozen base stored in bf16 on a CPU with bf16 matmuls
  (AVX512-BF16/AMX), else fp32;
- transformers' LlamaForCausalLM + peft LoRA at rank 8 and 32 on the same modules (q k v o gate up down), in
  the three ways users run it: fp32 (from_pretrained's default here), fp32 weights under bf16 autocast (what
  transformers' Trainer does with bf16=True), and bf16 weights (dtype=torch.bfloat16; peft keeps the
  adapters in fp32). "vs peft" divides by the fastest of the three at the same rank;
- both compiled at r32: ember's compile=true against torch.compile of the peft model under autocast ("vs
  peft" of the compiled ember row is against the compiled peft row);
- the allocator: on CPU ember's Trainer tells glibc's malloc to keep freed memory for reuse
  (`ember.hardware.cpu_allocator.keep_freed_cpu_memory`), so every ember row runs that way, as a user's run does, and
  every peft row with glibc's defaults, as a user's script does. Two more r32 contestants compare like
  for like: ember with glibc's defaults (EMBER_CPU_MALLOC=default) against peft autocast, and peft
  autocast with freed memory kept against ember;
- measured: seconds per training step (forward, loss, backward, clip, AdamW; median over the steps after
  warm-up), tokens/s, the process's peak resident memory (ru_maxrss), and the bytes of the training state
  by tensor: gradients (summed over the parameters holding one after backward) and optimizer state
  (every tensor in the optimizer's state), beside the formula for LoRA: gradients 4 bytes and AdamW's two
  moments 8 bytes per adapter parameter (fp32).

Rounds alternate over the contestants (each in its own process); a figure is the median over rounds.

    python benchmarks/finetune_memory.py                  # debug and 110M, 2 rounds
    python benchmarks/finetune_memory.py --models debug --rounds 1 --steps 3

Writes benchmarks/results/finetune_memory-<device>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

MODELS = {
    "debug": {},  # the debug recipe's Llama 3: dim 256, 4 layers, vocab 8192
    "110M": {"dim": 768, "n_layers": 12, "n_heads": 12, "n_kv_heads": 4, "vocab_size": 32000},
}
# name -> (framework, LoRA rank (0: full), precision, malloc, torch.compile). malloc "kept": glibc keeps freed
# memory for reuse, as ember sets it on CPU (cpu_allocator.keep_freed_cpu_memory); "default": glibc's defaults.
EMBER, PEFT = "kept", "default"  # each as a user gets it
CONTESTANTS = {
    "ember full": ("ember", 0, "auto", EMBER, False), "ember full bf16": ("ember", 0, "bf16", EMBER, False),
    "ember lora r8": ("ember", 8, "auto", EMBER, False), "ember lora r32": ("ember", 32, "auto", EMBER, False),
    "peft lora r8 fp32": ("peft", 8, "fp32", PEFT, False),
    "peft lora r8 autocast": ("peft", 8, "autocast", PEFT, False),
    "peft lora r8 bf16": ("peft", 8, "bf16", PEFT, False), "peft lora r32 fp32": ("peft", 32, "fp32", PEFT, False),
    "peft lora r32 autocast": ("peft", 32, "autocast", PEFT, False),
    "peft lora r32 bf16": ("peft", 32, "bf16", PEFT, False),
    # like for like on the allocator: ember with glibc's defaults, peft with freed memory kept
    "ember lora r32 glibc default": ("ember", 32, "auto", "default", False),
    "peft lora r32 autocast malloc kept": ("peft", 32, "autocast", "kept", False),
    # both sides compiled: ember's compile=true (per block) and torch.compile of the peft model
    "ember lora r32 compiled": ("ember", 32, "auto", EMBER, True),
    "peft lora r32 autocast compiled": ("peft", 32, "autocast", PEFT, True),
}
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    return _tensor_bytes(v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))


def worker(spec: dict) -> dict:
    """One contestant in this process: build, warm up, time `steps` steps, measure the state."""
    framework, rank, precision, malloc, compiled = CONTESTANTS[spec["contestant"]]
    if framework == "ember" and malloc == "default":
        os.environ["EMBER_CPU_MALLOC"] = "default"  # the Trainer leaves glibc's defaults alone
    elif framework == "peft" and malloc == "kept":
        from ember.hardware.cpu_allocator import keep_freed_cpu_memory

        keep_freed_cpu_memory()  # what the Trainer does on CPU
    torch.manual_seed(0)
    batch, seq, base = spec["batch"], spec["seq"], spec["base"]
    autocast = contextlib.nullcontext()
    if framework == "ember":
        from ember.train import run as run_lib
        from ember.train.trainer import Trainer

        overrides = [f"model.init_from={base}", "data.dataset=synthetic", "metrics.console=false",
                     f"output_dir={spec['out']}", f"seq_len={seq}", f"global_batch_size={batch}",
                     f"micro_batch_size={batch}", "resume=none", f"precision={precision}",
                     f"compile={compiled}".lower()]
        if rank:
            overrides += [f"lora.rank={rank}", "lora.alpha=16", "lora.targets=all"]
        trainer = Trainer(run_lib.load_config("debug", overrides))
        vocab = trainer.spec.args.vocab_size
        model, optimizer = trainer.model, trainer.optimizer
        compute = str(trainer.spec.compute_dtype).removeprefix("torch.")

        def step(inputs: torch.Tensor, labels: torch.Tensor) -> None:
            trainer.train_step([(inputs, labels)])

        def backward_only(inputs: torch.Tensor, labels: torch.Tensor) -> None:
            trainer.engine.forward_backward.run([(inputs, labels)], backward=True)
    else:
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaForCausalLM

        from ember.config import OptimConfig
        from ember.train.optim import build_optimizer

        weights = torch.bfloat16 if precision == "bf16" else torch.float32
        hf = LlamaForCausalLM.from_pretrained(base, dtype=weights, attn_implementation="sdpa")
        if precision == "autocast":
            autocast = torch.autocast("cpu", dtype=torch.bfloat16)
        compute = "float32" if precision == "fp32" else "bfloat16"
        model = get_peft_model(hf, LoraConfig(r=rank, lora_alpha=16, target_modules=HF_TARGETS, lora_dropout=0.0,
                                              bias="none", task_type="CAUSAL_LM")).train()
        vocab = hf.config.vocab_size
        optimizer = build_optimizer(model, OptimConfig(), "cpu")  # ember's AdamW settings, trainable parameters

        forward = torch.compile(model) if compiled else model

        def backward_only(inputs: torch.Tensor, labels: torch.Tensor) -> None:
            with autocast:
                loss = forward(input_ids=inputs, labels=labels, shift_labels=labels).loss
            loss.backward()

        def step(inputs: torch.Tensor, labels: torch.Tensor) -> None:
            backward_only(inputs, labels)
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    generator = torch.Generator().manual_seed(1)
    inputs = torch.randint(0, vocab, (batch, seq), generator=generator)
    labels = torch.randint(0, vocab, (batch, seq), generator=generator)
    for _ in range(spec["warmup"]):
        step(inputs, labels)
    times = []
    for _ in range(spec["steps"]):
        start = time.perf_counter()
        step(inputs, labels)
        times.append(time.perf_counter() - start)
    backward_only(inputs, labels)  # the gradients one backward leaves, measured before any step frees them
    grad_bytes = _tensor_bytes(p.grad for p in model.parameters() if p.grad is not None)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"seconds_per_step": statistics.median(times), "tokens_per_s": batch * seq / statistics.median(times),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "trainable_params": trainable, "grad_bytes": grad_bytes, "optimizer_bytes": _optimizer_bytes(optimizer),
            "formula_bytes": 12 * trainable if rank else None, "compute_dtype": compute}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))))
        return 0
    import peft
    import transformers

    from ember.model_io.convert import save_hf
    from ember.models import MODELS as FAMILIES, build_model_args
    from results_file import write_results

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model_name in args.models:
            margs = build_model_args("llama3", "debug", MODELS[model_name])
            torch.manual_seed(0)
            with torch.device("meta"):
                model = FAMILIES["llama3"].model_cls(margs)
            model.to_empty(device="cpu")
            model.init_weights()
            base = Path(tmp) / f"base-{model_name}"
            save_hf(model, margs, base)
            del model
            runs: dict[str, list[dict]] = {c: [] for c in CONTESTANTS}
            for _ in range(args.rounds):
                for contestant in CONTESTANTS:
                    spec = {"contestant": contestant, "base": str(base), "batch": args.batch, "seq": args.seq,
                            "steps": args.steps, "warmup": args.warmup, "out": str(Path(tmp) / "run")}
                    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)],
                                          capture_output=True, text=True)
                    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
                    if proc.returncode or not line:
                        print(proc.stderr[-3000:], file=sys.stderr)
                        raise SystemExit(f"{contestant} on {model_name} failed")
                    runs[contestant].append(json.loads(line[0][len("RESULT "):]))
            # "vs full": against ember's full fine-tuning in the same compute dtype
            full_tps = {results[-1]["compute_dtype"]: statistics.median(r["tokens_per_s"] for r in results)
                        for name, results in runs.items() if name in ("ember full", "ember full bf16")}
            for contestant, results in runs.items():
                row = {"model": model_name, "contestant": contestant, **results[-1],
                       "seconds_per_step": statistics.median(r["seconds_per_step"] for r in results),
                       "tokens_per_s": statistics.median(r["tokens_per_s"] for r in results),
                       "tokens_per_s_rounds": [round(r["tokens_per_s"], 1) for r in results],  # the spread
                       "peak_rss_bytes": max(r["peak_rss_bytes"] for r in results)}
                row["vs_full"] = row["tokens_per_s"] / full_tps[row["compute_dtype"]]
                rows.append(row)
            mine = {r["contestant"]: r for r in rows if r["model"] == model_name}
            for rank in (8, 32):
                ember_row = mine[f"ember lora r{rank}"]
                best = max((r for name, r in mine.items() if name.startswith(f"peft lora r{rank} ")
                            and CONTESTANTS[name][3:] == (PEFT, False)), key=lambda r: r["tokens_per_s"])
                ember_row["vs_peft"] = ember_row["tokens_per_s"] / best["tokens_per_s"]
                ember_row["fastest_peft"] = best["contestant"]
            # like for like on the allocator, both ways
            kept, default = mine["peft lora r32 autocast malloc kept"], mine["peft lora r32 autocast"]
            mine["ember lora r32"]["vs_peft_malloc_kept"] = (mine["ember lora r32"]["tokens_per_s"]
                                                             / kept["tokens_per_s"])
            mine["ember lora r32 glibc default"]["vs_peft"] = (mine["ember lora r32 glibc default"]["tokens_per_s"]
                                                              / default["tokens_per_s"])
            mine["ember lora r32 glibc default"]["fastest_peft"] = "peft lora r32 autocast"
            mine["ember lora r32 compiled"]["vs_peft"] = (mine["ember lora r32 compiled"]["tokens_per_s"]
                                                         / mine["peft lora r32 autocast compiled"]["tokens_per_s"])
            mine["ember lora r32 compiled"]["fastest_peft"] = "peft lora r32 autocast compiled"
    print(f"\nfine-tuning, {platform.machine()} CPU, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"batch {args.batch} x seq {args.seq}, median of {args.rounds} rounds")
    print(f"{'model':<7}{'contestant':<35}{'compute':>9}{'tok/s':>9}{'vs full':>9}{'vs peft':>9}{'peak RSS':>11}"
          f"{'trainable':>12}{'grad+optim bytes':>18}{'LoRA formula':>14}")
    for r in rows:
        state = r["grad_bytes"] + r["optimizer_bytes"]
        formula = f"{r['formula_bytes']:,}" if r["formula_bytes"] else "-"
        vs_peft = f"{r['vs_peft']:.2f}x" if "vs_peft" in r else "-"
        print(f"{r['model']:<7}{r['contestant']:<35}"
              f"{r['compute_dtype'].replace('bfloat', 'bf').replace('float', 'fp'):>9}"
              f"{r['tokens_per_s']:>9,.0f}{r['vs_full']:>8.2f}x{vs_peft:>9}"
              f"{r['peak_rss_bytes'] / 2**20:>9,.0f}MB{r['trainable_params']:>12,}{state:>18,}{formula:>14}")
    for r in rows:
        if "vs_peft_malloc_kept" in r:
            print(f"{r['model']}: ember lora r32 vs peft r32 autocast, both with freed memory kept: "
                  f"{r['vs_peft_malloc_kept']:.2f}x")
    write_results("finetune_memory", rows, args, transformers=transformers.__version__, peft=peft.__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
