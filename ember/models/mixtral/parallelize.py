"""How the MoE families (Mixtral, GLaM) are parallelised, in the order of ARCHITECTURE.md: expert
parallelism -> TP/SP -> CP -> activation checkpointing -> compile per block -> FSDP2.

Attention, norms, embeddings, the head and GLaM's dense feed-forwards take Llama's tensor-parallel plan.
A MoE layer is not split by tensor parallelism: it runs on each tensor rank's own sequence shard (the
residual stream is sequence-parallel between sublayers anyway), routing and dispatching those tokens
only. Its parameters are then replicated over the tensor axis and see different tokens there, so for
them the tensor axis is a data axis: FSDP shards them and sums their gradients over it too
(ParallelMesh.moe_fsdp_mesh / expert_fsdp_mesh). This is Megatron-LM's MoE "parallel folding" with an
expert tensor-parallel size of 1; it keeps the MoE free of the all-gather + reduce-scatter a
tensor-parallel MoE would add, and each expert's matrices whole for the grouped GEMM. Context
parallelism needs nothing of the MoE: its ranks hold different tokens already.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import PrepareModuleInputOutput

from ember.models.llama.parallelize import _settle_embedding_output
from ember.models.llama.parallelize import tp_plan as llama_tp_plan
from ember.nn.moe import MoE
from ember.parallel.ac import apply_ac
from ember.parallel.cp import apply_cp
from ember.parallel.ep import apply_ep
from ember.parallel.fsdp import apply_fsdp
from ember.parallel.tp import apply_tp


def tp_plan(loss_parallel: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Llama's plan (its feed_forward entries serve GLaM's dense layers, whose GELU gate is w1), plus the
    MoE layer: its sequence-sharded input handed over as the local shard, its output taken back as one."""
    top, block = llama_tp_plan(loss_parallel)
    block = dict(block)
    block["moe"] = PrepareModuleInputOutput(
        input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_input=True,
        output_layouts=(Shard(1),), desired_output_layouts=(Shard(1),), use_local_output=False)
    return top, block


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
                cpu_offload: bool = False, loss_parallel: bool = True, cp_impl: str = "allgather",
                **unsupported: Any) -> nn.Module:
    """Shared by the MoE families: `model.moe_layers()` names what expert parallelism shards."""
    sub = mesh.submesh if mesh is not None else (lambda *axes: None)
    ep_mesh, tp_mesh, cp_mesh = sub("expert"), sub("tensor"), sub("context")
    moe_layers = model.moe_layers()
    if ep_mesh is not None:
        apply_ep(moe_layers, ep_mesh)
    if tp_mesh is not None:
        apply_tp(model, tp_mesh, *tp_plan(loss_parallel))
        model.tie_weights()  # GLaM: the embedding and output, both vocabulary-sharded now, one matrix again
    if cp_mesh is not None:
        apply_cp(model, cp_mesh, cp_impl)
    apply_ac(model, remat, remat_every)
    if compile:
        if tp_mesh is not None and model.tok_embeddings is not None:
            model.tok_embeddings.register_forward_hook(_settle_embedding_output)
        apply_compile(model)
    if mesh is None:
        return model
    # Units with meshes of their own, inner first: experts (EP-sharded: reduced over the ranks holding
    # the same experts), then under TP the MoE layer's remaining parameters (tensor ranks as data ranks).
    own_units: list[tuple[nn.Module, Optional[Any]]] = []
    if ep_mesh is not None:
        own_units += [(moe.experts, mesh.expert_fsdp_mesh()) for moe in moe_layers]
    if tp_mesh is not None:
        own_units += [(moe, mesh.moe_fsdp_mesh()) for moe in moe_layers]
    apply_fsdp(model, mesh.fsdp_mesh(), param_dtype=param_dtype, reduce_dtype=reduce_dtype,
               reshard_after_forward=reshard_after_forward, cpu_offload=cpu_offload, own_units=own_units)
    return model
