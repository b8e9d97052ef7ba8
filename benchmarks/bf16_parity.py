"""Whether precision=auto may train in bf16 on a CPU: the default run's losses under bf16 autocast against fp32.

precision=auto picks bf16 autocast on CPUs with bf16 matmul instructions (AVX512-BF16, AMX, ARM BF16) on the
condition this measures: the default `ember train` run (the debug recipe, unchanged) logs a loss within 1% of
fp32's at every logged step, and a validation loss within 1%. Both runs train in this process from the same
seed on the same data; the bf16 run is precision=auto with EMBER_CPU_BF16=1, so it is auto's own choice that
is measured.

On a CPU without those instructions torch emulates bf16 matmuls (~1 GFLOP/s here, a 200-step run would take
over an hour), so the bf16 run's matmuls go through `NativeBf16Matmuls`: each bf16 matmul computed as an fp32
matmul of its bf16 operands, rounded to bf16. That is what the bf16 instructions compute (bf16 inputs, exact
products, fp32 accumulation, a bf16 result), up to the order of the sums, at fp32 speed. Everything else
(autocast's casts, attention's bf16 kernel, the fp32 loss and optimizer) runs as it would there. The output
says which of the two ran.

    python benchmarks/bf16_parity.py                    # the default run: 200 steps, both precisions
    python benchmarks/bf16_parity.py --max-steps 40     # what tests/train/test_precision_auto.py runs

Prints the losses side by side and writes benchmarks/results/bf16_parity-cpu.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))
from results_file import write_results  # noqa: E402

TOLERANCE = 0.01  # the relative loss difference precision=auto's bf16 must stay within
_aten = torch.ops.aten


class NativeBf16Matmuls(TorchDispatchMode):
    """bf16 matmuls as a CPU with bf16 instructions computes them (bf16 operands, fp32 accumulation, a bf16
    result), run as fp32 matmuls of the bf16 values: the same numbers at fp32 speed on a CPU that emulates bf16."""

    MATMULS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in self.MATMULS and any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args):
            widened = [a.float() if isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 else a for a in args]
            return func(*widened, **kwargs).bfloat16()
        return func(*args, **kwargs)


def run_losses(precision: str, output_dir: Path, overrides: list[str], emulate: bool) -> dict[str, Any]:
    """Train the debug recipe with `overrides` in this process; its logged losses by step, validation loss and
    compute dtype. precision=bf16-auto: precision=auto on a CPU taken to have bf16 matmuls."""
    from ember.train import run as run_lib
    from ember.train.trainer import Trainer

    auto_bf16 = precision == "bf16-auto"
    previous = os.environ.get("EMBER_CPU_BF16")
    os.environ["EMBER_CPU_BF16"] = "1" if auto_bf16 else "0"
    try:
        cfg = run_lib.load_config("debug", [f"precision={'auto' if auto_bf16 else precision}",
                                            f"output_dir={output_dir}", "metrics.console=false", *overrides])
        mode = NativeBf16Matmuls() if auto_bf16 and emulate else contextlib.nullcontext()
        with mode:
            trainer = Trainer(cfg)
            trainer.train()
    finally:
        os.environ.pop("EMBER_CPU_BF16") if previous is None else os.environ.update(EMBER_CPU_BF16=previous)
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    val = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    return {"compute_dtype": str(trainer.spec.compute_dtype).replace("torch.", ""), "losses": losses,
            "val_loss": val[-1] if val else None}


def compare(fp32: dict[str, Any], bf16: dict[str, Any]) -> dict[str, Any]:
    """Per logged step, bf16's loss relative to fp32's; the largest such difference and the validation loss's."""
    steps = sorted(fp32["losses"])
    if steps != sorted(bf16["losses"]):
        raise ValueError(f"the runs logged different steps: {steps} vs {sorted(bf16['losses'])}")
    rel = {s: abs(bf16["losses"][s] - fp32["losses"][s]) / fp32["losses"][s] for s in steps}
    val_rel = abs(bf16["val_loss"] - fp32["val_loss"]) / fp32["val_loss"]
    worst = max(rel, key=rel.get)
    return {"per_step_rel": rel, "max_step_rel": rel[worst], "max_step": worst, "val_rel": val_rel,
            "within": rel[worst] <= TOLERANCE and val_rel <= TOLERANCE}


def parity(max_steps: Optional[int], emulate: bool) -> dict[str, Any]:
    """Both runs of the default job (max_steps None: the recipe's), and their comparison."""
    overrides = [f"max_steps={max_steps}"] if max_steps else []
    with tempfile.TemporaryDirectory() as tmp:
        fp32 = run_losses("fp32", Path(tmp) / "fp32", overrides, emulate)
        bf16 = run_losses("bf16-auto", Path(tmp) / "bf16", overrides, emulate)
    return {"fp32": fp32, "bf16": bf16, **compare(fp32, bf16)}


def main() -> int:
    from ember.hardware.device import cpu_runs_bf16_natively

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=None, help="default: the debug recipe's 200")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    native = cpu_runs_bf16_natively()
    result = parity(args.max_steps, emulate=not native)
    how = ("native bf16 matmuls" if native else
           "bf16 matmuls emulated exactly as fp32 products of bf16 operands (this CPU has no bf16 instructions)")
    print(f"\nbf16 autocast (precision=auto on a bf16 CPU: {result['bf16']['compute_dtype']}) vs "
          f"{result['fp32']['compute_dtype']}, the default run; {how}")
    print(f"{'step':>6}{'fp32':>10}{'bf16':>10}{'rel diff':>10}")
    for step, rel in result["per_step_rel"].items():
        print(f"{step:>6}{result['fp32']['losses'][step]:>10.4f}{result['bf16']['losses'][step]:>10.4f}{rel:>9.2%}")
    print(f"{'val':>6}{result['fp32']['val_loss']:>10.4f}{result['bf16']['val_loss']:>10.4f}{result['val_rel']:>9.2%}")
    verdict = "within" if result["within"] else "NOT within"
    print(f"largest step difference {result['max_step_rel']:.2%} (step {result['max_step']}): {verdict} "
          f"{TOLERANCE:.0%}")
    row = {"steps": max(result["fp32"]["losses"]), "matmuls": "native" if native else "emulated",
           "compute_dtypes": [result["fp32"]["compute_dtype"], result["bf16"]["compute_dtype"]],
           "max_step_rel": result["max_step_rel"], "max_step": result["max_step"], "val_rel": result["val_rel"],
           "within_1pct": result["within"], "fp32_val_loss": result["fp32"]["val_loss"],
           "bf16_val_loss": result["bf16"]["val_loss"],
           "losses": {str(s): [result["fp32"]["losses"][s], result["bf16"]["losses"][s]]
                      for s in result["per_step_rel"]}}
    write_results("bf16_parity", [row], args)
    return 0 if result["within"] else 1


if __name__ == "__main__":
    sys.exit(main())
