"""Measure what `ember plan` predicts, in real CPU runs (tests/plan/test_plan_accuracy.py and
benchmarks/plan_accuracy.py): `measure_layouts` launches

    torchrun --nproc-per-node N -m ember.plan.measure OUT.json '{"name": [overrides...], ...}' RECIPE BASE...

For each layout every rank builds the real Trainer, takes one training step (the optimizer state exists
from then on, as in every later step), then takes a second one under torch's MemTracker
(ember.plan.trackers.step_memory_tracker: it allows the root module several forwards per step). The peak is the
tracker's: every tensor storage alive at each op of the real kernels, the real gloo collectives, FSDP's
buffers (their storage resizes included) and the optimizer's update, counted at the torch level (a CPU has
no allocator statistics like torch.cuda.max_memory_allocated; the process RSS mixes in Python, libraries and
freed-but-kept pages). Parameter, gradient and optimizer bytes are read from the tensors themselves: the
local shards, the gradients after a forward/backward, the optimizer's state.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ember.plan.trackers import step_memory_tracker, total_bytes
from ember.train import run as run_lib
from ember.train.trainer import Trainer


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def measure(trainer: Trainer) -> dict:
    for part in trainer.model_parts:  # fp32 experts under a dispatch-mode tracker: see memory.balanced_routing
        for moe in part.moe_layers():
            moe.experts.force_impl("looped")
    batches = trainer.global_batches()
    trainer.train_step(next(batches))  # creates the optimizer state
    params = [p for p in trainer.model.parameters()]
    tracker = step_memory_tracker()
    tracker.track_external(trainer.model, trainer.optimizer)
    with tracker:
        trainer.train_step(next(batches))
    peak = total_bytes(tracker.get_tracker_snapshot("peak"))
    trainer.engine.forward_backward.run(next(batches), backward=True)
    grad = sum(_local_bytes(p.grad) for p in params if p.grad is not None)
    trainer.optimizer.zero_grad(set_to_none=True)
    optim = sum(_local_bytes(v) for state in trainer.optimizer.state.values() for v in state.values()
                if isinstance(v, torch.Tensor))
    return {"param_bytes": sum(_local_bytes(p) for p in params), "grad_bytes": grad, "optim_bytes": optim,
            "peak_bytes": peak}


# The small layouts the plan is checked against, by world size: a debug Llama 3 (dim 256, 4 layers, vocab
# 8192), Mixtral's debug flavor for experts, GPT 126M (125M parameters) for a model of real width, and the debug
# flavors of the families with pieces of their own (Qwen3, Qwen3-MoE, Mistral, Llama 4).
RECIPE = "debug"
BASE = ["data.dataset=synthetic", "seq_len=256", "micro_batch_size=4", "global_batch_size=8"]
LAYOUTS: dict[int, dict[str, list[str]]] = {
    2: {
        "fsdp=2": ["ici_mesh.fsdp=2"],
        "tensor=2": ["ici_mesh.tensor=2", "ici_mesh.fsdp=1"],
        "pipeline=2 (1f1b)": ["ici_mesh.pipeline=2", "ici_mesh.fsdp=1"],
        "pipeline=2 (gpipe)": ["ici_mesh.pipeline=2", "ici_mesh.fsdp=1", "parallel.pp_schedule=gpipe"],
        "pipeline=2 (interleaved)": ["ici_mesh.pipeline=2", "ici_mesh.fsdp=1", "parallel.pp_schedule=interleaved_1f1b",
                                     "parallel.pp_stages_per_rank=2"],
        "context=2": ["ici_mesh.context=2", "ici_mesh.fsdp=1"],
        "fsdp=2 remat=full": ["ici_mesh.fsdp=2", "model.remat=full"],
        "mixtral expert=2": ["model.family=mixtral", "model.flavor=debug", "ici_mesh.expert=2", "ici_mesh.fsdp=1"],
        "gpt-126m fsdp=2": ["model.family=gpt", "model.flavor=126M", "ici_mesh.fsdp=2", "seq_len=128",
                            "micro_batch_size=2", "global_batch_size=4"],
        # Qwen3's q/k norms and wide heads split by tensor; Qwen3-MoE's 16 experts; Mistral's sliding window
        "qwen3 tensor=2": ["model.family=qwen3", "model.flavor=debug", "ici_mesh.tensor=2", "ici_mesh.fsdp=1"],
        "qwen3_moe expert=2": ["model.family=qwen3_moe", "model.flavor=debug", "ici_mesh.expert=2", "ici_mesh.fsdp=1"],
        "mistral fsdp=2": ["model.family=mistral", "model.flavor=debug", "ici_mesh.fsdp=2"],
        # Llama 4's interleaved MoE layers with a shared expert (measured 1.5-1.9% under the peak)
        "llama4 expert=2": ["model.family=llama4", "model.flavor=debug", "ici_mesh.expert=2", "ici_mesh.fsdp=1"],
        # DeepSeek-V3: MLA (its latent projections replicated over tensor ranks), grouped experts with a shared one
        # (measured 4.4-4.6% under the peak at expert=2, 0.05% under at tensor=2)
        "deepseek_v3 expert=2": ["model.family=deepseek_v3", "model.flavor=debug", "ici_mesh.expert=2",
                                 "ici_mesh.fsdp=1"],
        "deepseek_v3 tensor=2": ["model.family=deepseek_v3", "model.flavor=debug", "ici_mesh.tensor=2",
                                 "ici_mesh.fsdp=1"],
    },
    4: {"fsdp=4": ["ici_mesh.fsdp=4", "micro_batch_size=2"],
        "data=2 x fsdp=2": ["ici_mesh.data=2", "ici_mesh.fsdp=2", "micro_batch_size=2"],
        "pipeline=2 x fsdp=2": ["ici_mesh.pipeline=2", "ici_mesh.fsdp=2", "micro_batch_size=2"]},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_layouts(world: int, cases: dict[str, list[str]], out: Path, recipe: str = RECIPE,
                    base: list[str] = BASE) -> dict[str, list[dict[str, int]]]:
    """Run `cases` as one torchrun job of `world` CPU processes (gloo); per case, each rank's measured bytes."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", f"--master-port={_free_port()}",
           "-m", "ember.plan.measure", str(out), json.dumps(cases), recipe, *base]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"measuring {list(cases)} on {world} ranks failed:\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def compare(world: int, name: str, overrides: list[str], measured: list[dict[str, int]], recipe: str = RECIPE,
            base: list[str] = BASE) -> list[dict[str, Any]]:
    """One row per rank: the plan's bytes beside the measured ones."""
    from ember.plan.planner import make_plan
    from ember.train import run as run_lib

    cfg = run_lib.load_config(recipe, [*base, *overrides], world_size=world)
    plan = make_plan(cfg, world, device="cpu")
    rows = []
    for planned, real in zip(plan.ranks, measured):
        row: dict[str, Any] = {"layout": name, "rank": planned.rank}
        for key in ("param_bytes", "grad_bytes", "optim_bytes", "peak_bytes"):
            row[f"planned_{key}"], row[f"measured_{key}"] = getattr(planned, key), real[key]
        row["peak_error"] = planned.peak_bytes / real["peak_bytes"] - 1
        rows.append(row)
    return rows


def main() -> None:
    out_path, cases, recipe, base = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4:]
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    results = {}
    for name, overrides in cases.items():
        out_dir = os.path.join(out_path + ".runs", name.replace(" ", "_"))
        if rank == 0:
            shutil.rmtree(out_dir, ignore_errors=True)
        cfg = run_lib.load_config(recipe, [*base, *overrides, f"output_dir={out_dir}", "metrics.console=false"],
                              world_size=world)
        measured = measure(Trainer(cfg))
        gathered = [None] * world
        dist.all_gather_object(gathered, measured)
        results[name] = gathered
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
