"""How the GPT family is parallelised, applied from outside the model, in the order of ARCHITECTURE.md:
TP/SP -> CP -> activation checkpointing -> compile per block -> FSDP2, with the shared pieces of
ember/parallel and Llama's per-block compile. The plan is Llama's, plus the position table and biases.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from ember.models.llama.parallelize import _settle_embedding_output, apply_compile
from ember.nn.attention import FlexDocumentAttention
from ember.parallel.ac import apply_ac
from ember.parallel.cp import apply_cp
from ember.parallel.fsdp import apply_fsdp
from ember.parallel.tp import apply_tp


def tp_plan(loss_parallel: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model-level plan, per-block plan). Between blocks the residual stream is sharded on the sequence
    (sequence parallel: the LayerNorms run on T/tp tokens, their weight and bias replicated); attention
    and MLP gather it, split heads / hidden units column-wise (each rank its slice of every bias), and
    reduce-scatter back to sequence shards in their row-wise output projection, whose bias is replicated
    and added once (Megatron-LM; Korthikanti et al. 2022 for the sequence-parallel part).

    Both lookup tables are split over their rows and reduce-scatter to sequence shards, so token and
    position embeddings arrive in the same layout and add locally. The model indexes the position table
    with (1 or B, T) positions for that reason: dim 1 is the sequence in both lookups."""
    def embedding() -> RowwiseParallel:
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)

    top = {
        "tok_embeddings": embedding(),
        "pos_embeddings": embedding(),
        "norm": SequenceParallel(),
        # Loss parallel: logits stay sharded over the vocabulary and cross-entropy runs on the shards.
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    }
    block = {
        "attention_norm": SequenceParallel(),
        # (x, document_ids): x arrives sequence-sharded and is gathered; document_ids stays a plain tensor.
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    return top, block


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
        # TP replaced the embedding and output weights by DTensors one by one; the tied pair becomes one
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
        if tp_mesh is not None:  # see llama/parallelize.py: compiled blocks must see settled DTensors
            for table in (model.tok_embeddings, model.pos_embeddings):
                if table is not None:
                    table.register_forward_hook(_settle_embedding_output)
        apply_compile(model)
    if fsdp_mesh is not None:
        # The position table is left to the root unit: it is small and used once, at the start.
        apply_fsdp(model, fsdp_mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                   reshard_after_forward=reshard_after_forward, cpu_offload=cpu_offload)
    return model
