"""Activation checkpointing (rematerialisation) policies, applied to each transformer block from outside.

none       keep every activation (fastest, most memory)
full       keep only each block's input; recompute the block in backward
selective  `full` on every `every`-th block (by layer index, so pipeline stages agree with the whole model)
op         keep the outputs of matmuls and attention, recompute the cheap element-wise ops between them
           (selective activation checkpointing: recompute costs a few % while most memory is element-wise)
offload    keep every activation, but in host memory (`save_on_cpu`), paged back for backward
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    create_selective_checkpoint_contexts,
)

if TYPE_CHECKING:
    from torch._ops import OpOverload

POLICIES = ("none", "full", "selective", "op", "offload")

# Ops whose outputs `op` keeps: the expensive ones to recompute. Looked up by name since the set of
# attention kernels differs between torch versions and builds.
_SAVE_OP_NAMES = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention",
                  "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                  "_scaled_dot_product_flash_attention_for_cpu")
_SAVE_OPS = {getattr(torch.ops.aten, n).default for n in _SAVE_OP_NAMES if hasattr(torch.ops.aten, n)}


def _save_matmuls(ctx: SelectiveCheckpointContext, op: OpOverload, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _rematerialised(forward: Callable, policy: str) -> Callable:
    if policy == "offload":
        def offloaded(*args: Any, **kwargs: Any) -> Any:
            with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
                return forward(*args, **kwargs)
        return offloaded
    context_fn = functools.partial(create_selective_checkpoint_contexts, _save_matmuls) if policy == "op" else None

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        extra = {"context_fn": context_fn} if context_fn is not None else {}
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)
    return checkpointed


def apply_ac(model: nn.Module, policy: str, every: int = 2) -> None:
    """Wrap each chosen block's forward in place. The block object (and so every parameter name, for
    checkpoints and FSDP) stays as it is; FSDP's hooks run outside the recomputed region."""
    if policy not in POLICIES:
        raise ValueError(f"unknown remat policy '{policy}' (choose from {', '.join(POLICIES)})")
    if policy == "none":
        return
    for name, block in model.layers.items():
        if policy == "selective" and int(name) % every:
            continue
        wrap_policy = "full" if policy == "selective" else policy
        block.forward = _rematerialised(block.forward, wrap_policy)
