"""The GPT family's tensor-parallel plan: Llama's, plus the position table and biases.
ember/parallel/parallelize.py applies it, with every other parallelism, in the fixed order of
docs/architecture.md.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel


def tp_plan(loss_parallel: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model-level plan, per-block plan). Between blocks the residual stream is sharded on the sequence
    (sequence parallel: the LayerNorms run on T/tp tokens, their weight and bias replicated); attention
    and MLP gather it, split heads / hidden units column-wise (each rank its slice of every bias), and
    reduce-scatter back to sequence shards in their row-wise output projection, whose bias is replicated
    and added once (Megatron-LM; Korthikanti et al. 2022 for the sequence-parallel part).

    Both lookup tables are split over their rows and reduce-scatter to sequence shards, so token and
    position embeddings arrive in the same layout and add locally. The model indexes the position table
    with (1 or B, T) positions for that reason: dim 1 is the sequence in both lookups."""
    def embedding() -> RowwiseParallel:
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)

    top = {
        "tok_embeddings": embedding(),
        "pos_embeddings": embedding(),
        "norm": SequenceParallel(),
        # Loss parallel: logits stay sharded over the vocabulary and cross-entropy runs on the shards.
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    }
    block = {
        "attention_norm": SequenceParallel(),
        # (x, document_ids): x arrives sequence-sharded and is gathered; document_ids stays a plain tensor.
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    return top, block
