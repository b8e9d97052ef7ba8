"""The new families on a CUDA GPU: what the CPU tests cannot show, checked and recorded.

1. Masks. Each family's debug flavor, built by the Trainer on the GPU (fp32, no TF32), runs its forward and
   backward twice on one batch: with the attention kernel the run assembles (flex attention's block masks
   where a layer has a sliding window or an attention chunk, or where documents are masked) and with the
   exact SDPA/mask path every CPU test uses. Logits and every gradient must agree, and the GPU's logits must
   equal the CPU's for the same weights. The sequence (256) is four windows/chunks long, so the masks matter.
2. Training. A few steps of each family with bf16 autocast, eager and compiled (`compile=true`, flex
   attention compiled into the blocks), from one seed and batch: the losses finite, and compiled equal to
   eager within bf16 noise. With `--fp8` the same for float8 linears (torchao), compiled.

    python benchmarks/cuda_families.py                 # every family, masks and training
    python benchmarks/cuda_families.py --families llama4 gemma2 --fp8

Writes benchmarks/results/cuda_families-cuda.json; exits 1 if a check fails (the JSON says which).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import tempfile
import time
import traceback
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ember.nn.attention import FlexAttention, causal_attention, document_layout, set_attention_kernel  # noqa: E402
from ember.train import run as run_lib  # noqa: E402
from ember.train.trainer import Trainer  # noqa: E402

# family -> extra overrides. Documents are masked for the families without local attention, so flex attention
# (and, for DeepSeek, its differing value width) runs on every one of them. The recipe's embedded data and
# tokenizer are built (its EOS marks the documents); the batches themselves are drawn here.
FAMILIES = {
    "qwen3": ["data.document_mask=true"], "qwen3_moe": ["data.document_mask=true"], "mistral": [], "phi3": [],
    "gemma3": [], "gemma2": [], "llama4": [], "deepseek_v3": ["data.document_mask=true"],
    "deepseek_v2": ["data.document_mask=true"],
}
SEQ, BATCH = 256, 2


def trainer_for(family: str, extra: list[str], out: str, *more: str) -> Trainer:
    cfg = run_lib.load_config("debug", [
        f"model.family={family}", "model.flavor=debug", "device=cuda", f"seq_len={SEQ}",
        f"global_batch_size={BATCH}", f"micro_batch_size={BATCH}", "metrics.console=false",
        "checkpoint.interval=0", "eval_interval=0", "resume=none", "seed=0", f"output_dir={out}", *extra, *more])
    return Trainer(cfg)


def batch(trainer: Trainer) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    eos = trainer.tokenizer.eos_id
    tokens = torch.randint(0, trainer.spec.args.vocab_size, (BATCH, SEQ + 1), generator=g)
    tokens[tokens == eos] = (eos + 1) % trainer.spec.args.vocab_size
    if trainer.cfg.data.document_mask:  # documents of uneven lengths, each ended by EOS
        tokens[0, [40, 41, 170]] = eos
        tokens[1, [100]] = eos
    return tokens[:, :-1].to(trainer.device), tokens[:, 1:].to(trainer.device)


def forward_backward(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
                     eos: int | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    document_ids, positions = document_layout(inputs, eos) if eos is not None else (None, None)
    logits = model(inputs, positions, document_ids)
    F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def check_masks(family: str, extra: list[str], out: str) -> dict:
    trainer = trainer_for(family, extra, out, "precision=fp32", "compile=false")
    model = trainer.model
    documents = trainer.cfg.data.document_mask
    eos = trainer.tokenizer.eos_id if documents else None
    kernels = sorted({type(m.attention_fn).__name__ for m in model.modules() if hasattr(m, "attention_fn")})
    inputs, labels = batch(trainer)
    flex_logits, flex_grads = forward_backward(model, inputs, labels, eos)
    if any(isinstance(getattr(m, "attention_fn", None), FlexAttention) for m in model.modules()):
        set_attention_kernel(model, causal_attention)  # flex is every layer's or none's (parallel/parallelize.py)
    exact_logits, exact_grads = forward_backward(model, inputs, labels, eos)
    cpu_logits, _ = forward_backward(copy.deepcopy(model).cpu(), inputs.cpu(), labels.cpu(), eos)
    grad_rel = max(relative(flex_grads[n], exact_grads[n]) for n in exact_grads)
    row = {"family": family, "kernels": kernels, "documents": documents,
           "logits_max_abs_flex_vs_sdpa": float((flex_logits - exact_logits).abs().max()),
           "logits_max_abs_gpu_vs_cpu": float((exact_logits.cpu() - cpu_logits).abs().max()),
           "grad_max_rel_flex_vs_sdpa": grad_rel}
    row["ok"] = (row["logits_max_abs_flex_vs_sdpa"] <= 1e-3 and row["logits_max_abs_gpu_vs_cpu"] <= 1e-3
                 and grad_rel <= 1e-3 and "FlexAttention" in kernels)
    return row


def train_losses(family: str, extra: list[str], out: str, *more: str, steps: int) -> list[float]:
    trainer = trainer_for(family, extra, out, *more)
    micro = [batch(trainer)]  # the Trainer lays out the documents itself (data.document_mask)
    return [trainer.train_step(micro)[0] for _ in range(steps)]


def check_training(family: str, extra: list[str], out: str, steps: int, fp8: bool) -> dict:
    row: dict = {"family": family}
    start = time.perf_counter()
    row["eager_bf16"] = train_losses(family, extra, out + "/e", "precision=bf16", "compile=false", steps=steps)
    row["compiled_bf16"] = train_losses(family, extra, out + "/c", "precision=bf16", "compile=true", steps=steps)
    gap = max(abs(a - b) for a, b in zip(row["eager_bf16"], row["compiled_bf16"]))
    row["max_abs_loss_gap_compiled_vs_eager"] = gap
    ok = all(math.isfinite(x) for x in row["eager_bf16"] + row["compiled_bf16"]) and gap <= 0.05
    ok = ok and row["eager_bf16"][-1] < row["eager_bf16"][0]  # one batch, repeated: the loss must fall
    if fp8:
        row["compiled_fp8"] = train_losses(family, extra, out + "/f", "precision=fp8", "compile=true", steps=steps)
        row["max_abs_loss_gap_fp8_vs_bf16"] = max(abs(a - b) for a, b in zip(row["compiled_fp8"], row["eager_bf16"]))
        ok = (ok and all(math.isfinite(x) for x in row["compiled_fp8"])
              and row["compiled_fp8"][-1] < row["compiled_fp8"][0])
    row["seconds"], row["ok"] = round(time.perf_counter() - start, 1), ok
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--fp8", action="store_true", help="also train each family with float8 linears")
    parser.add_argument("--skip", nargs="*", default=[], choices=["masks", "training"])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("cuda_families.py needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 comparisons: TF32 would be the difference measured
    torch.backends.cudnn.allow_tf32 = False
    result = {"benchmark": "cuda_families", "date": date.today().isoformat(),
              "machine": torch.cuda.get_device_name(), "torch": torch.__version__, "masks": [], "training": []}
    path = args.out / "cuda_families-cuda.json"
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for part, check in (("masks", lambda f: check_masks(f, FAMILIES[f], f"{tmp}/{f}-m")),
                            ("training", lambda f: check_training(f, FAMILIES[f], f"{tmp}/{f}-t", args.steps,
                                                                  args.fp8))):
            if part in args.skip:
                continue
            for family in args.families:
                try:
                    row = check(family)
                except Exception as error:  # one family's failure is recorded, the others still run
                    row = {"family": family, "ok": False, "error": f"{type(error).__name__}: {error}"[:2000]}
                    traceback.print_exc()
                print(part, json.dumps(row), flush=True)
                result[part].append(row)
                path.write_text(json.dumps(result, indent=2) + "\n")
    failed = [f"{part}:{r['family']}" for part in ("masks", "training") for r in result[part] if not r["ok"]]
    print(f"wrote {path}; " + (f"FAILED: {', '.join(failed)}" if failed else "every check passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
