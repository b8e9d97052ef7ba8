"""How the Mixtral family is parallelised: expert parallelism -> activation checkpointing -> compile
per block -> FSDP2 (non-expert parameters over fsdp x expert, experts over the ranks that share them).

Tensor and context parallelism are not wired for this family yet; the config refuses them.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ember.nn.moe import MoE
from ember.parallel.ac import apply_ac
from ember.parallel.ep import apply_ep
from ember.parallel.fsdp import apply_fsdp


def apply_compile(model: nn.Module) -> None:
    """Compile each block's parts except its MoE layer: routing reads the tokens per expert on the host
    (split sizes for the looped experts and the all-to-all), which a full graph cannot hold, so the MoE
    runs eagerly and attention, norms and dense feed-forwards are compiled, each as one full graph."""
    for block in model.layers.values():
        for child in block.children():
            if not isinstance(child, MoE):
                child.compile(fullgraph=True)


def parallelize(model: nn.Module, mesh: Optional[Any] = None, *, compile: bool = False, remat: str = "none",
                remat_every: int = 2, param_dtype: Optional[torch.dtype] = None,
                reduce_dtype: Optional[torch.dtype] = None, reshard_after_forward: bool = True,
                cpu_offload: bool = False, **unsupported: Any) -> nn.Module:
    """Shared by the MoE families (Mixtral, GLaM): `model.moe_layers()` names what expert parallelism shards."""
    if mesh is not None and (mesh.submesh("tensor") is not None or mesh.submesh("context") is not None):
        raise ValueError("MoE families run with data, fsdp, expert and pipeline axes; tensor and context are not supported yet")
    ep_mesh = mesh.submesh("expert") if mesh is not None else None
    if ep_mesh is not None:
        apply_ep(model.moe_layers(), ep_mesh)
    apply_ac(model, remat, remat_every)
    if compile:
        apply_compile(model)
    fsdp_mesh = mesh.fsdp_mesh() if mesh is not None else None
    if fsdp_mesh is not None:
        experts = [moe.experts for moe in model.moe_layers()] if ep_mesh is not None else []
        apply_fsdp(model, fsdp_mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                   reshard_after_forward=reshard_after_forward, cpu_offload=cpu_offload,
                   expert_modules=experts, expert_mesh=mesh.expert_fsdp_mesh())
    return model
