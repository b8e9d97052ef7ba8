"""One rank of tests/finetune/test_grpo_rollout.py's sharded rollout: the tiny Llama sharded with FSDP over 2 ranks,
each rank sampling its own prompts; a stop string ends every row of rank 0 long before rank 1's. Writes the
rank's greedy completions before and after sharding to OUT-rank<r>.json."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ember.finetune.grpo_rollout import sample
from ember.parallel.fsdp import apply_fsdp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: tests.helpers
from tests.helpers import IdTokenizer, tiny_llama  # noqa: E402

out = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
model = tiny_llama(64)
# rank 0's rows stop after 2 tokens (the next starts with "1": 1 or 10-19); rank 1's run to max_new_tokens
prompts = [[11, 12, 13]] if rank == 0 else [[5, 6, 7, 8], [14, 15, 16, 17, 18]]
options = dict(max_new_tokens=12, temperature=0.0, stop=[" 1"])
alone = sample(model, IdTokenizer(), prompts, 2, **options)
apply_fsdp(model, init_device_mesh("cpu", (2,)))
with torch.no_grad():
    sharded = sample(model, IdTokenizer(), prompts, 2, sharded=True, **options)
json.dump({"alone": alone.completion_ids, "sharded": sharded.completion_ids, "truncated": alone.truncated},
          open(f"{out}-rank{rank}.json", "w"))
dist.destroy_process_group()
