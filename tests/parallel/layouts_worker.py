"""Run several parallel layouts in one torchrun job (one process group shared by all of them) and write
each layout's per-step losses and grad norms as JSON. Launched by test_layouts.py:

    torchrun --nproc-per-node N layouts_worker.py OUT.json '{"name": [overrides...], ...}' BASE_OVERRIDES...
"""

import json
import os
import shutil
import sys

import torch.distributed as dist

from ember.train import run as run_lib
from ember.train.trainer import Trainer


def main() -> None:
    out_path, cases, base = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:]
    world = int(os.environ["WORLD_SIZE"])
    results = {}
    for name, overrides in cases.items():
        # Every rank uses the same directory: DCP writes one checkpoint from all ranks.
        out_dir = os.path.join(out_path + ".runs", name)
        if int(os.environ["RANK"]) == 0:
            shutil.rmtree(out_dir, ignore_errors=True)
        cfg = run_lib.load_config("debug", [*base, *overrides, f"output_dir={out_dir}", "metrics.console=false"],
                              world_size=world)
        trainer = Trainer(cfg)
        trainer.train()
        if trainer.is_main:
            records = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
            steps = [r for r in records if "loss" in r]
            results[name] = {
                "loss": [r["loss"] for r in steps],
                "grad_norm": [r["grad_norm"] for r in steps],
                "val_loss": next((r["val_loss"] for r in records if "val_loss" in r), None),
                "expert_load": [r.get("moe/layer0/tokens_per_expert") for r in steps],  # MoE models only
            }
    if int(os.environ["RANK"]) == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
