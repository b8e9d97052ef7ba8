"""Tensor (and sequence) parallelism from a dict plan keyed by module name."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, top_plan: dict[str, ParallelStyle],
             block_plan: dict[str, ParallelStyle]) -> None:
    """Apply `top_plan` to the model's own submodules and `block_plan` to every block in model.layers,
    each entry only where its module is present (a pipeline stage may lack the embedding or the head;
    GLaM's blocks hold either a MoE layer or a dense feed-forward)."""
    for module, plan in [(model, top_plan)] + [(block, block_plan) for block in model.layers.values()]:
        present = {name: style for name, style in plan.items() if _has(module, name)}
        if present:
            parallelize_module(module, tp_mesh, present)


def _has(module: nn.Module, dotted: str) -> bool:
    for part in dotted.split("."):
        module = getattr(module, part, None)
        if module is None:
            return False
    return True
