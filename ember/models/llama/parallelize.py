"""How the Llama family is parallelised, applied from outside the model, in the order of ARCHITECTURE.md:
TP/SP -> CP -> activation checkpointing -> compile per block -> FSDP2. (Pipeline splitting happens
before, in the trainer: each stage is a Transformer holding some layers, parallelised the same way.)
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from ember.nn.attention import FlexDocumentAttention
from ember.parallel.ac import apply_ac
from ember.parallel.cp import apply_cp
from ember.parallel.fsdp import apply_fsdp
from ember.parallel.tp import apply_tp


def tp_plan(loss_parallel: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model-level plan, per-block plan). Between blocks the residual stream is sharded on the sequence
    (sequence parallel: norms run on T/tp tokens); attention and FFN gather it, split heads / hidden
    units column-wise, and reduce-scatter back to sequence shards in their row-wise output projection
    (Megatron-LM; Korthikanti et al. 2022 for the sequence-parallel part).

    The residual stream stays a DTensor (use_local_output=False) so that compiled blocks take and return
    DTensors: with plain local tensors at the block boundary, torch 2.13's AOT autograd hands the
    embedding's redistribute a plain-tensor gradient and backward fails."""
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
        "norm": SequenceParallel(),
        # Loss parallel: logits stay sharded over the vocabulary and cross-entropy runs on the shards.
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    }
    block = {
        "attention_norm": SequenceParallel(),
        # (x, cos, sin, document_ids): x arrives sequence-sharded and is gathered; the rest are plain tensors.
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                        desired_input_layouts=(Replicate(), None, None, None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "feed_forward.w3": ColwiseParallel(),
    }
    return top, block


def _settle_embedding_output(module: nn.Module, inputs: Any, output: Any) -> Any:
    # The embedding's reduce-scatter leaves an async collective tensor inside its DTensor output; a
    # compiled block traced on that input is then reused for the next blocks' plain tensors and fails
    # (torch 2.13). Waiting here (an elementwise copy, once per forward) gives every block the same kind.
    from torch.distributed.tensor import DTensor

    local = output.to_local() * 1  # differentiable, and a plain tensor once the collective is done
    return DTensor.from_local(local, output.device_mesh, output.placements, run_check=False)


def apply_compile(model: nn.Module) -> None:
    # Per block rather than the whole model: the blocks share one graph, so it is compiled once and
    # reused, and FSDP can later wrap each compiled block on its own. Module.compile works in place,
    # so parameter names (and checkpoints) do not gain an `_orig_mod.` prefix.
    for block in model.layers.values():
        block.compile(fullgraph=True)


def parallelize(
    model: nn.Module,
    mesh: Optional[Any] = None,
    *,
    compile: bool = False,
    remat: str = "none",
    remat_every: int = 2,
    param_dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = None,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    loss_parallel: bool = True,
    cp_impl: str = "allgather",
    flex_attention: bool = False,
) -> nn.Module:
    """Apply this family's parallelism to `model` (built on meta), in place. `mesh` is an
    ember.parallel.mesh.ParallelMesh, or None for a single device."""
    tp_mesh = mesh.submesh("tensor") if mesh is not None else None
    cp_mesh = mesh.submesh("context") if mesh is not None else None
    fsdp_mesh = mesh.fsdp_mesh() if mesh is not None else None
    if tp_mesh is not None:
        apply_tp(model, tp_mesh, *tp_plan(loss_parallel))
        # TP replaced the embedding and output weights by DTensors one by one; a tied pair becomes one
        # again (both are sharded over the vocabulary, Shard(0), so the layouts agree).
        model.tie_weights()
    if cp_mesh is not None:
        apply_cp(model, cp_mesh, cp_impl)
    if flex_attention:  # document masking on CUDA: one shared kernel, so layers reuse one BlockMask per batch
        kernel = FlexDocumentAttention()
        for block in model.layers.values():
            block.attention.attention_fn = kernel
    apply_ac(model, remat, remat_every)
    if compile:
        if tp_mesh is not None and model.tok_embeddings is not None:
            model.tok_embeddings.register_forward_hook(_settle_embedding_output)
        apply_compile(model)
    if fsdp_mesh is not None:
        apply_fsdp(model, fsdp_mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                   reshard_after_forward=reshard_after_forward, cpu_offload=cpu_offload)
    return model
