"""task=grpo's update is the same on every layout: FSDP=2 and TP=2 on torchrun (gloo), full and LoRA, equal one
process on the same rollouts, for each loss type, with a KL reference, several iterations and batch-scaled
advantages. The rollouts are fixed by grpo_fixtures.fixed_sample, since sampling itself is seeded per data-parallel
rank (a layout with another width samples other completions); the rewards, their gathering over ranks, the
advantages, the old and reference log-probs and the update all run as in training."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ember.train import run as run_lib
from ember.train.trainer import Trainer
from tests.finetune.grpo_fixtures import say_prompts, word_tokenizer
from tests.helpers import job_env, tiny_model

WORKER = Path(__file__).parent / "grpo_layout_worker.py"
SHAPE = [*tiny_model(2), "model.vocab_size=16", "seq_len=16"]
CASES = {
    "dapo": [],
    "grpo_kl": ["grpo.loss_type=grpo", "grpo.beta=0.1"],
    "dr_grpo_iterations": ["grpo.loss_type=dr_grpo", "grpo.iterations=2", "grpo.scale_rewards=batch",
                           "grpo.mask_truncated=true"],
    "lora_kl": ["lora.rank=4", "lora.alpha=8", "grpo.beta=0.1"],
    "sampled": ["max_steps=1"],  # rollouts from the sharded policy itself
}
LAYOUTS = {"fsdp": ["ici_mesh.fsdp=2"], "tensor": ["ici_mesh.tensor=2", "ici_mesh.fsdp=1"]}


def _run(out: Path, nproc: int, base: list[str]) -> dict:
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                     "--nproc-per-node", str(nproc)]
    proc = subprocess.run([*launcher, str(WORKER), str(out), json.dumps(CASES), *base], capture_output=True,
                          text=True, env=job_env(), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=True)


@pytest.mark.slow
def test_fsdp_and_tensor_parallel_grpo_updates_equal_one_process(tmp_path):
    lm = tmp_path / "base"
    Trainer(run_lib.load_config("debug", [*SHAPE, "data.dataset=synthetic", "max_steps=1", "global_batch_size=4",
                                          "micro_batch_size=4", "metrics.console=false", f"output_dir={lm}"])).train()
    CASES["lora_kl"] = [*CASES["lora_kl"], f"model.init_from={lm / 'checkpoints' / 'step-1'}"]
    base = ["task=grpo", f"data.dataset={say_prompts(tmp_path / 'say.jsonl')}",
            f"data.tokenizer={word_tokenizer(tmp_path / 'tok')}",
            "grpo.rewards=[tests.finetune.grpo_fixtures:yes_fraction]", *SHAPE, "global_batch_size=16",
            "micro_batch_size=8", "grpo.group_size=8", "grpo.max_new_tokens=6", "optim.lr=1e-2", "precision=fp32",
            "optim.eps=1e-4",  # (Adam with a tiny eps turns gradients at rounding level into whole steps)
            "schedule.warmup_steps=0", "metrics.console=false", "logging_steps=1", "max_steps=3"]
    alone = _run(tmp_path / "alone.pt", 1, base)
    for layout, overrides in LAYOUTS.items():
        result = _run(tmp_path / f"{layout}.pt", 2, [*base, *overrides])
        # Sampled on the sharded model: under TP (one data-parallel rank, the same seed) the very completions of one
        # process; FSDP's two ranks sample with seeds of their own, so only the step's having learnt is compared.
        sampled, sampled_alone = result["sampled"]["steps"][1], alone["sampled"]["steps"][1]
        if layout == "tensor":
            assert sampled == pytest.approx(sampled_alone, rel=1e-4)
        assert sampled[1] > 0
        for case in (c for c in CASES if c != "sampled"):
            ours, theirs = result[case], alone[case]
            assert ours["steps"].keys() == theirs["steps"].keys() == {1, 2, 3}
            for step, (loss, grad_norm) in theirs["steps"].items():
                assert ours["steps"][step][0] == pytest.approx(loss, rel=1e-5, abs=1e-6), (layout, case, step)
                assert ours["steps"][step][1] == pytest.approx(grad_norm, rel=1e-4), (layout, case, step)
            assert theirs["steps"][1][1] > 0  # the rewards differ within groups: the update moved something
            for key, weight in theirs["weights"].items():
                torch.testing.assert_close(ours["weights"][key], weight, rtol=1e-4, atol=1e-6,
                                           msg=lambda m: f"{layout} {case} {key}: {m}")
