"""How the Llama family is parallelised, applied from outside the model.

This version applies torch.compile per transformer block; tensor/sequence parallel, activation
checkpointing and FSDP2 join here (in that order, before compile and FSDP) with the parallelism work.
"""

from __future__ import annotations

from typing import Optional

from torch import nn


def apply_compile(model: nn.Module) -> None:
    # Per block, not the whole model: every block has the same graph, so one compilation is reused
    # by all of them, and FSDP can wrap each compiled block on its own later.
    for block in model.layers.values():
        block.compile(fullgraph=True)


def parallelize(model: nn.Module, mesh: Optional[object] = None, *, compile: bool = False) -> nn.Module:
    if mesh is not None:
        raise NotImplementedError("parallelism over a DeviceMesh is not in this version of ember")
    if compile:
        apply_compile(model)
    return model
