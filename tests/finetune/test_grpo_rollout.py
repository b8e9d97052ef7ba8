"""GRPO's rollouts (ember/finetune/grpo_rollout.py): groups of completions sampled from the policy with the KV
cache, reproducible from a seed, and training rows whose targets sit where the policy's logits predict them: a
greedy rollout's every completion token is the argmax of the training forward at its masked position."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ember.finetune.grpo_rollout import Rollouts, sample, training_rows
from tests.helpers import IdTokenizer, job_env, tiny_llama

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]  # of different lengths: left-padded in generation


def test_groups_are_consecutive_and_a_seed_reproduces_them():
    model = tiny_llama(64)
    first = sample(model, IdTokenizer(), PROMPTS, 4, max_new_tokens=6, temperature=1.0, seed=3)
    again = sample(model, IdTokenizer(), PROMPTS, 4, max_new_tokens=6, temperature=1.0, seed=3)
    other = sample(model, IdTokenizer(), PROMPTS, 4, max_new_tokens=6, temperature=1.0, seed=4)
    assert first.prompt_ids == [p for p in PROMPTS for _ in range(4)]
    assert first.completion_ids == again.completion_ids and first.completion_ids != other.completion_ids
    assert len({tuple(c) for c in first.completion_ids[:4]}) > 1  # sampled: a group's completions differ
    for ids, truncated in zip(first.completion_ids, first.truncated):
        assert (len(ids) == 6 and 1 not in ids) if truncated else ids[-1] == 1  # EOS kept, and only at the end


def test_a_greedy_rollouts_tokens_are_the_argmax_where_the_training_rows_put_them():
    model = tiny_llama(64)
    rollouts = sample(model, IdTokenizer(), PROMPTS, 2, max_new_tokens=8, temperature=0.0)
    inputs, targets, mask = training_rows(rollouts)
    assert mask.sum().item() == sum(len(c) for c in rollouts.completion_ids)
    with torch.no_grad():
        predicted = model(inputs).argmax(-1)
    assert torch.equal(predicted[mask.bool()], targets[mask.bool()])
    for i, (prompt, completion) in enumerate(zip(rollouts.prompt_ids, rollouts.completion_ids)):
        assert inputs[i, :len(prompt) + len(completion)].tolist() == prompt + completion


def test_truncated_completions_can_be_left_out_of_the_loss():
    rollouts = Rollouts([[5, 6], [7]], [[8, 9, 1], [10, 11]], ["", ""], [False, True])
    inputs, targets, mask = training_rows(rollouts, mask_truncated=True)
    assert inputs.tolist() == [[5, 6, 8, 9, 1], [7, 10, 11, 0, 0]]
    assert targets.tolist() == [[0, 8, 9, 1, 0], [10, 11, 0, 0, 0]]
    assert mask.tolist() == [[0, 1, 1, 1, 0], [0, 0, 0, 0, 0]]
    assert training_rows(rollouts)[2][1].tolist() == [1, 1, 0, 0, 0]


@pytest.mark.slow
def test_a_rollout_on_an_fsdp_sharded_policy_equals_one_process(tmp_path):
    """Two ranks, FSDP, different prompts whose rows stop at different steps: every rank keeps decoding until all
    are done (each forward is collective), and each rank's greedy completions equal its prompts' on one process."""
    out = tmp_path / "rollout"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(Path(__file__).parent / "grpo_rollout_worker.py"), str(out)],
                          capture_output=True, text=True, env=job_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(2):
        result = json.loads(Path(f"{out}-rank{rank}.json").read_text())
        assert result["sharded"] == result["alone"]
    longest = [max(len(c) for c in json.loads(Path(f"{out}-rank{rank}.json").read_text())["alone"])
               for rank in range(2)]
    assert longest[0] < longest[1] == 12  # rank 0 was done first: alone, it would have left rank 1 waiting
