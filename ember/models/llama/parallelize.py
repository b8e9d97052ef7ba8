"""The Llama family's tensor-parallel plan; ember/parallel/parallelize.py applies it, with every other
parallelism, in the fixed order of docs/architecture.md. Mixtral and GLaM use this plan too (their dense
parts have the same names; the pipeline adds the MoE layer's entry).
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel


def tp_plan(loss_parallel: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model-level plan, per-block plan). Between blocks the residual stream is sharded on the sequence
    (sequence parallel: norms run on T/tp tokens); attention and FFN gather it, split heads / hidden
    units column-wise, and reduce-scatter back to sequence shards in their row-wise output projection
    (Megatron-LM; Korthikanti et al. 2022 for the sequence-parallel part).

    The residual stream stays a DTensor (use_local_output=False) so that compiled blocks take and return
    DTensors: with plain local tensors at the block boundary, torch 2.13's AOT autograd hands the
    embedding's redistribute a plain-tensor gradient and backward fails."""
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
        "norm": SequenceParallel(),
        # Loss parallel: logits stay sharded over the vocabulary and cross-entropy runs on the shards.
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    }
    block = {
        "attention_norm": SequenceParallel(),
        # (x, cos, sin, document_ids): x arrives sequence-sharded and is gathered; the rest are plain tensors.
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                        desired_input_layouts=(Replicate(), None, None, None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "feed_forward.w3": ColwiseParallel(),
    }
    return top, block
