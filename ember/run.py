"""Decisions about a run that follow from its config and mesh, made in one place.

The trainer (ember/train.py) and the planner (ember/plan/memory.py) both call these, so what `ember plan`
models is what `ember train` builds; a rule copied into each drifted within a day. This is the start of the
one frozen description of a run that docs/architecture.md's principles ask for.
"""

from __future__ import annotations

from typing import Any

import torch


def uses_loss_parallel(cfg: Any, shape: Any) -> bool:
    """Cross-entropy on vocabulary-sharded logits: with tensor > 1 and parallel.loss_parallel, never with a
    pipeline, nor for task=dpo (which sums each row's log-probabilities from whole logits). `cfg` is a
    JobConfig, `shape` a MeshShape."""
    return (shape.degree("tensor") > 1 and cfg.parallel.loss_parallel and shape.degree("pipeline") == 1
            and cfg.task != "dpo")


def uses_fsdp_mixed_precision(cfg: Any, shape: Any, compute_dtype: torch.dtype) -> bool:
    """FSDP's mixed precision (low-precision parameters, fp32 gradient reduction) instead of autocast: where
    FSDP reduces gradients over more than one rank, parallel.mixed_precision is on, and compute is not fp32."""
    return shape.grad_sync > 1 and cfg.parallel.mixed_precision and compute_dtype != torch.float32
