"""Tensor (and sequence) parallelism from a dict plan keyed by module name."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module


def apply_tp(model: nn.Module, tp_mesh: Any, top_plan: dict[str, ParallelStyle], block_plan: dict[str, ParallelStyle]) -> None:
    """Apply `top_plan` to the model's own submodules (those present: a pipeline stage may lack some)
    and `block_plan` to every block in model.layers."""
    present = {name: style for name, style in top_plan.items() if getattr(model, name, None) is not None}
    if present:
        parallelize_module(model, tp_mesh, present)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan)
