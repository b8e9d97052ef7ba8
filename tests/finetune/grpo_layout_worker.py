"""One process (or one rank) of test_grpo_layouts.py: trains each case of task=grpo with the rollouts fixed (the
fixture's sampler in place of the policy's, so every layout trains on the same completions; a case named sampled*
samples from the policy) and writes, from rank 0,
each case's logged (loss, grad_norm) per step and its whole weights:

    python grpo_layout_worker.py OUT.pt '{"name": [overrides...], ...}' BASE_OVERRIDES...
"""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: tests.*
import ember.finetune.grpo as grpo_lib  # noqa: E402
from ember.train import run as run_lib  # noqa: E402
from ember.train.trainer import Trainer  # noqa: E402
from tests.finetune.grpo_fixtures import fixed_sample  # noqa: E402
from tests.helpers import losses_by_step  # noqa: E402

real_sample = grpo_lib.sample


def main() -> None:
    out, cases, base = Path(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3:]
    results = {}
    for name, overrides in cases.items():
        grpo_lib.sample = real_sample if name.startswith("sampled") else fixed_sample
        run_dir = Path(f"{out}.runs") / name
        trainer = Trainer(run_lib.load_config("debug", [*base, *overrides, f"output_dir={run_dir}"],
                                              world_size=int(os.environ.get("WORLD_SIZE", 1))))
        trainer.train()
        weights = {key: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                   for key, p in trainer.model.named_parameters()}
        if trainer.is_main:
            results[name] = {"steps": losses_by_step(run_dir), "weights": weights}
    if results:
        torch.save(results, out)


if __name__ == "__main__":
    main()
