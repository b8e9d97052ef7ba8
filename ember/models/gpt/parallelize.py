"""The GPT family's tensor-parallel plan: Llama's (ColwiseParallel/RowwiseParallel split the biases with
their weights), plus the position table, without SwiGLU's w3, and attention without RoPE inputs.
ember/parallel/parallelize.py applies it, with every other parallelism, in the fixed order of
docs/architecture.md.
"""

from __future__ import annotations

import copy
from typing import Any

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput

from ember.models.llama.parallelize import tp_plan as llama_tp_plan


def tp_plan(loss_parallel: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model-level plan, per-block plan). Between blocks the residual stream is sharded on the sequence
    (sequence parallel: the LayerNorms run on T/tp tokens, their weight and bias replicated); attention
    and MLP gather it, split heads / hidden units column-wise (each rank its slice of every bias), and
    reduce-scatter back to sequence shards in their row-wise output projection, whose bias is replicated
    and added once (Megatron-LM; Korthikanti et al. 2022 for the sequence-parallel part).

    Both lookup tables are split over their rows and reduce-scatter to sequence shards, so token and
    position embeddings arrive in the same layout and add locally. The model indexes the position table
    with (1 or B, T) positions for that reason: dim 1 is the sequence in both lookups."""
    top, block = llama_tp_plan(loss_parallel)
    top = {**top, "pos_embeddings": copy.deepcopy(top["tok_embeddings"])}  # the same layout as the tokens'
    block = {name: style for name, style in block.items() if name != "feed_forward.w3"}  # a plain GELU MLP
    # (x, document_ids): x arrives sequence-sharded and is gathered; document_ids stays a plain tensor.
    block["attention"] = PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))
    return top, block
