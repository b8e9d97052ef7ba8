"""How the Llama family is parallelised, applied from outside the model.

This version compiles each transformer block. Tensor/sequence parallelism, activation checkpointing
and FSDP2 join here as small `apply_*` functions, called by `parallelize` in the order of
ARCHITECTURE.md: TP -> AC -> compile -> FSDP.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn


def apply_compile(model: nn.Module) -> None:
    # Per block rather than the whole model: the blocks share one graph, so it is compiled once and
    # reused, and FSDP can later wrap each compiled block on its own. Module.compile works in place,
    # so parameter names (and checkpoints) do not gain an `_orig_mod.` prefix.
    for block in model.layers.values():
        block.compile(fullgraph=True)


def parallelize(model: nn.Module, mesh: Optional[Any] = None, *, compile: bool = False) -> nn.Module:
    """Apply this family's parallelism and compilation to `model` (built on meta or a device), in place."""
    if mesh is not None:
        raise NotImplementedError("parallelising over a DeviceMesh is not implemented yet in ember")
    if compile:
        apply_compile(model)
    return model
