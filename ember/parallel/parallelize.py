"""One parallelize pipeline for every family, applied from outside the model in a fixed order:

    (FP8 linears) -> TP/SP -> (LoRA) -> CP -> (flex attention) -> activation checkpointing -> compile per block
    -> EP -> FSDP2

A family supplies only its tensor-parallel plan (models/<family>/parallelize.py); what expert parallelism
shards is the model's own MoE layers (`Decoder.moe_layers()`). Pipeline splitting happens before, in
ember/train/run.py's build_model: each stage is the same Decoder class holding some layers and is parallelised the
same way. See docs/architecture.md for where each axis comes from.

MoE layers under tensor parallelism are not split: each runs on its tensor rank's own sequence shard (the
residual stream is sequence-parallel between sublayers anyway), routing and dispatching those tokens only.
Their parameters are then replicated over the tensor axis and see different tokens there, so for them the
tensor axis is a data axis: FSDP shards them and sums their gradients over it too
(ParallelMesh.moe_fsdp_mesh / expert_fsdp_mesh). This is Megatron-LM's MoE "parallel folding" with an
expert tensor-parallel size of 1: no all-gather + reduce-scatter around the MoE, and each expert's
matrices stay whole for the grouped GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import PrepareModuleInputOutput

from ember.nn.attention import FlexAttention, set_attention_kernel
from ember.nn.moe import MoE
from ember.parallel.ac import apply_ac
from ember.parallel.cp import apply_cp
from ember.parallel.ep import apply_ep
from ember.parallel.fp8 import apply_fp8, fp8_all_gather, fp8_tp_plan
from ember.parallel.fsdp import apply_fsdp
from ember.parallel.tp import apply_tp

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from ember.parallel.mesh import ParallelMesh


@dataclass(frozen=True)
class ParallelOptions:
    """What `parallelize` applies besides the mesh and the family's TP plan: the parallel part of a run
    (ember.train.run.RunSpec.parallel), decided by ember.train.run.resolve. The defaults apply nothing but the mesh."""

    compile: bool = False
    remat: str = "none"
    remat_every: int = 2
    param_dtype: Optional[torch.dtype] = None  # FSDP mixed precision: parameters gathered in this dtype
    reduce_dtype: Optional[torch.dtype] = None  # and gradients reduced in this one
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    loss_parallel: bool = True
    cp_impl: str = "allgather"
    flex_attention: bool = False  # document masking by flex attention's block masks (CUDA)
    fp8_recipe: Optional[str] = None
    fp8_emulate: bool = False


TPPlan = Callable[[bool], tuple[dict[str, Any], dict[str, Any]]]  # loss_parallel -> (model plan, block plan)


def moe_tp_style() -> PrepareModuleInputOutput:
    """A MoE layer under TP: its sequence-sharded input handed over as the local shard, its output taken back."""
    return PrepareModuleInputOutput(
        input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_input=True,
        output_layouts=(Shard(1),), desired_output_layouts=(Shard(1),), use_local_output=False)


def settle_embedding_output(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: DTensor) -> DTensor:
    """Forward hook for embeddings under TP with compiled blocks. The embedding's reduce-scatter leaves an
    async collective tensor inside its DTensor output; a compiled block traced on that input is then reused
    for the next blocks' plain tensors and fails (torch 2.13). Waiting here (an elementwise copy, once per
    forward) gives every block the same kind of input."""
    local = output.to_local() * 1  # differentiable, and a plain tensor once the collective is done
    return DTensor.from_local(local, output.device_mesh, output.placements, run_check=False)


def _prepare_flex_masks(kernel: FlexAttention, model: nn.Module, args: tuple, kwargs: dict) -> None:
    """The model's forward pre-hook under flex attention: this batch's block masks, built before any block runs.
    The forward's (tokens or hidden states (B, T, ...), positions, document_ids), positional or by keyword."""
    document_ids = kwargs.get("document_ids", args[2] if len(args) > 2 else None)
    kernel.prepare(document_ids, args[0].shape[1], args[0].device)


def apply_compile(model: nn.Module) -> None:
    """torch.compile per block rather than the whole model: the blocks share one graph, compiled once and
    reused, and FSDP can later wrap each compiled block on its own. Module.compile works in place, so
    parameter names (and checkpoints) gain no `_orig_mod.` prefix. In a model with MoE layers each block's
    other children are compiled and the MoE runs eagerly: routing reads the tokens per expert on the host
    (split sizes for the looped experts and the all-to-all), which a full graph cannot hold."""
    has_moe = bool(model.moe_layers())
    for block in model.layers.values():
        if not has_moe:
            block.compile(fullgraph=True)
            continue
        for child in block.children():
            if not isinstance(child, MoE):
                child.compile(fullgraph=True)


def parallelize(model: nn.Module, mesh: Optional[ParallelMesh], tp_plan: TPPlan,
                options: ParallelOptions = ParallelOptions(), *,
                lora: Optional[Callable[[nn.Module], list[str]]] = None) -> nn.Module:
    """Apply every parallelism to `model` (a Decoder or pipeline stage built on meta), in place. `mesh` is an
    ember.parallel.mesh.ParallelMesh, or None for a single device; an axis of degree 1 is skipped. `options`
    is the run's (ember.train.run.RunSpec.parallel). `lora`: ember.finetune.lora.apply_lora with its settings bound,
    run right after TP (its docstring says why). options.fp8_recipe (tensorwise | rowwise) converts the
    linears to float8 training first (ember/parallel/fp8.py)."""
    fp8_recipe, loss_parallel = options.fp8_recipe, options.loss_parallel
    sub = mesh.submesh if mesh is not None else (lambda *axes: None)
    tp_mesh, cp_mesh, ep_mesh = sub("tensor"), sub("context"), sub("expert")
    moe_layers = model.moe_layers()
    embeddings = [m for m in (model.tok_embeddings, getattr(model, "pos_embeddings", None)) if m is not None]
    if fp8_recipe is not None:  # before TP: torchao's float8 parallel styles expect Float8Linear modules
        apply_fp8(model, fp8_recipe, options.fp8_emulate, fsdp_float8_all_gather=fp8_all_gather(mesh, fp8_recipe))
    if tp_mesh is not None:
        top, block = tp_plan(loss_parallel)
        if moe_layers:
            block = {**block, "moe": moe_tp_style()}
        if fp8_recipe == "tensorwise" and tp_mesh.device_type == "cuda":  # gloo cannot move float8 tensors
            block = fp8_tp_plan(block)
        apply_tp(model, tp_mesh, top, block)
        # TP replaced the embedding and output weights by DTensors one by one; a tied pair becomes one
        # again (both are sharded over the vocabulary, Shard(0), so the layouts agree).
        model.tie_weights()
    if lora is not None:
        lora(model)
    if cp_mesh is not None:
        apply_cp(model, cp_mesh, options.cp_impl)
    if options.flex_attention:  # document masking on CUDA: one shared kernel, so layers reuse one BlockMask per batch
        kernel = FlexAttention(getattr(layer.attention, "span", None) for layer in model.layers.values())
        set_attention_kernel(model, kernel)
        model.register_forward_pre_hook(partial(_prepare_flex_masks, kernel), with_kwargs=True)
    apply_ac(model, options.remat, options.remat_every)
    if options.compile:
        if tp_mesh is not None:
            for table in embeddings:
                table.register_forward_hook(settle_embedding_output)
        apply_compile(model)
    if ep_mesh is not None:
        apply_ep(moe_layers, ep_mesh)
    if mesh is None:
        return model
    # Units with meshes of their own, inner first: experts (EP-sharded: reduced over the ranks holding
    # the same experts), then under TP each MoE layer's remaining parameters (tensor ranks as data ranks).
    own_units: list[tuple[nn.Module, Optional[DeviceMesh]]] = []
    if ep_mesh is not None:
        own_units += [(moe.experts, mesh.expert_fsdp_mesh()) for moe in moe_layers]
    if tp_mesh is not None:
        own_units += [(moe, mesh.moe_fsdp_mesh()) for moe in moe_layers]
    apply_fsdp(model, mesh.fsdp_mesh(), param_dtype=options.param_dtype, reduce_dtype=options.reduce_dtype,
               reshard_after_forward=options.reshard_after_forward, cpu_offload=options.cpu_offload,
               own_units=own_units)
    return model


@torch.no_grad()
def init_weights(model_parts: list[nn.Module], build_full_model: Callable[[], nn.Module], seed: int,
                 device: torch.device, distributed: bool) -> None:
    """Random init of this rank's (sharded) parameters, seeded by `seed`.

    On CUDA, DTensor's offset-based RNG gives each shard its own part of one random stream. On a CPU mesh,
    DTensor random ops draw the same numbers on every rank (CPU generators have no offsets), so FSDP/TP
    shards would be copies of one another: there one full copy is initialised (`build_full_model()`, on
    meta) and each rank keeps its shard, the values a single process would have, whatever the layout."""
    torch.manual_seed(seed)
    if not distributed or device.type != "cpu":
        for part in model_parts:
            part.init_weights(buffer_device=device)
        return
    full = build_full_model()
    full.to_empty(device="cpu")
    full.init_weights()
    full_state = full.state_dict()
    for part in model_parts:
        part.init_rope(device)
        for name, tensor in part.state_dict().items():
            source = full_state.get(name)
            if source is None:  # a LoRA adapter: ember.finetune.lora.init_lora fills it
                continue
            if isinstance(tensor, DTensor):
                shard = distribute_tensor(source, tensor.device_mesh, tensor.placements, src_data_rank=None)
                tensor.to_local().copy_(shard.to_local())
            else:
                tensor.copy_(source)
