"""The Qwen families' tensor-parallel plan: Llama's (ember/models/llama/parallelize.py), plus Qwen3's q/k
norms. Their weight is shared by every head, while each rank holds n_heads / tp of the heads: the norm takes
its input as sharded on the head dim (SequenceParallel over dim 2 of (B, T, heads, head_dim)), so the weight's
gradient is the sum over every rank's heads, as in one process."""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor.parallel import SequenceParallel

from ember.models.llama.parallelize import tp_plan as llama_tp_plan


def tp_plan(loss_parallel: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model-level plan, per-block plan) for Qwen3 (dense and MoE); Qwen2 has no q/k norms and uses Llama's."""
    top, block = llama_tp_plan(loss_parallel)
    heads = SequenceParallel(sequence_dim=2, use_local_output=True)
    return top, {**block, "attention.q_norm": heads, "attention.k_norm": heads}
