"""Gemma 3's tensor-parallel plan: Llama's (ember/models/llama/parallelize.py) with its q/k norms sharded over
heads (as Qwen3's, ember/models/qwen/parallelize.py) and its two extra block norms, which run on the residual
stream's sequence shards like the other two."""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor.parallel import SequenceParallel

from ember.models.qwen.parallelize import tp_plan as qk_norm_tp_plan


def tp_plan(loss_parallel: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    top, block = qk_norm_tp_plan(loss_parallel)
    return top, {**block, "post_attention_norm": SequenceParallel(), "post_ffn_norm": SequenceParallel()}


def gemma2_tp_plan(loss_parallel: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Gemma 2's: Gemma 3's without the q/k norms it does not have."""
    top, block = tp_plan(loss_parallel)
    return top, {key: style for key, style in block.items() if key not in ("attention.q_norm", "attention.k_norm")}
