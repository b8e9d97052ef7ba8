"""Attention on the XLA path: every attention kernel runs with its operands' shardings pinned (`pinned_layout`), and
on TPUs it is jax's Pallas flash-attention kernel (causal, grouped-query heads, packed documents as its segment ids)
in place of SDPA's math, which XLA would lower to a materialised (T, T) score matrix per head. The kernel is per
device, so it runs under shard_map: batch rows over the data-parallel axes, heads over tensor. Elsewhere (jax's CPU
or GPU backends, a context-parallel sequence split, or a sequence the kernel's 128-token blocks do not tile) the
model keeps nn/attention.causal_attention, the exact SDPA math."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch

from ember.nn.attention import AttentionSpan, Kernel, causal_attention
from ember.xla.mesh import BATCH_AXES, present

BLOCK = 128  # the kernel's smallest block along the sequence


def attention_kernel(platform: str, mesh: Any) -> Kernel:
    """The attention kernel of a run on `mesh`: the TPU kernel where it applies, else SDPA's math; its layout pinned."""
    if uses_flash(platform, mesh):  # already per device, under its own shard_map
        return pinned_layout(mesh, flash_attention(mesh), per_device_heads=False)
    return pinned_layout(mesh, causal_attention)


def pinned_layout(mesh: Any, kernel: Kernel, per_device_heads: bool = True) -> Kernel:
    """`kernel` with the shardings of its operands and output fixed, as the torch path lays them out: rows over the
    data-parallel axes, heads over tensor, the queries' sequence over context and the keys' and values' whole (the
    all-gathered K/V of parallel/cp.py). Why: left to sharding propagation, the weights' FSDP sharding reaches into
    attention, and where it splits a K/V head across the context axis while a data shard holds one row (the issue's
    data|fsdp=2 x context=2 x tensor=2 and data=2 x context=4 at micro_batch_size=1) jax 0.10's Shardy partitioner
    computes the backward of the (B * heads) batched matmul that torch's 4-D matmul lowers to wrongly: K's and V's
    gradients came back off by more than their own size while the loss was right (tests/xla/test_xla_layouts.py
    keeps every 8-device layout of every attention kind equal to one device). Pinned, no such sharding exists.
    Under tensor parallelism without a context split the kernel runs per device (shard_map), each on its rows and
    its heads, as the TPU kernel does itself (`per_device_heads=False`: a shard_map may not nest another over the
    same axes)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from torchax import interop

    def split(size: int, axes: tuple[str, ...]) -> Any:  # the axes of degree > 1, where they divide the dimension
        axes = present(mesh, axes)
        if not axes or size % math.prod(mesh.shape[a] for a in axes):
            return None
        return axes if len(axes) > 1 else axes[0]

    def place(t: torch.Tensor, sequence: tuple[str, ...]) -> torch.Tensor:  # t: (B, heads, T, head_dim)
        spec = P(split(t.shape[0], BATCH_AXES), split(t.shape[1], ("tensor",)), split(t.shape[2], sequence), None)
        return interop.call_jax(jax.lax.with_sharding_constraint, t, NamedSharding(mesh, spec))

    def per_device(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: Optional[torch.Tensor],
                   span: Optional[AttentionSpan]) -> torch.Tensor:
        # Each device runs `kernel` on its own rows and heads. Through sharding propagation alone, the
        # (B * heads, T, head_dim) batched matmuls SDPA lowers to lost the heads' tensor split: every tensor rank
        # computed every head of its rows, twice the attention FLOPs at tensor=2 (the compiled HLO's dots).
        rows, heads = split(q.shape[0], BATCH_AXES), present(mesh, ("tensor",))
        qkv = P(rows, heads, None, None)

        def local(q: Any, k: Any, v: Any, ids: Any) -> Any:
            return interop.call_torch(lambda *t: kernel(*t, span), q, k, v, ids)

        return interop.call_jax(lambda *a: jax.shard_map(
            local, mesh=mesh, in_specs=(qkv, qkv, qkv, None if document_ids is None else P(rows, None)),
            out_specs=qkv, check_vma=False)(*a), q, k, v, document_ids)

    def pinned(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: Optional[torch.Tensor] = None,
               span: Optional[AttentionSpan] = None) -> torch.Tensor:
        q, k, v = place(q, ("context",)), place(k, ()), place(v, ())
        tensor = mesh.shape["tensor"]
        # per device where every device holds whole sequences and whole groups of heads: the queries' heads and
        # the keys' split alike (a K/V head replicated while its query heads split would pair the wrong heads)
        if (per_device_heads and tensor > 1 and mesh.shape["context"] == 1 and q.shape[1] % tensor == 0
                and k.shape[1] % tensor == 0):
            return place(per_device(q, k, v, document_ids, span), ("context",))
        return place(kernel(q, k, v, document_ids, span), ("context",))

    return pinned


def uses_flash(platform: str, mesh: Any) -> bool:
    """The TPU kernel: on TPUs, without a context-parallel split of the sequence (each device would see only its
    slice of the keys)."""
    return platform == "tpu" and mesh.shape["context"] == 1


def flash_attention(mesh: Any) -> Callable[..., torch.Tensor]:
    """An attention kernel (nn/attention.Kernel), (q, k, v, document_ids) over (B, heads, T, head_dim) ->
    (B, heads, T, head_dim), running the TPU kernel on `mesh`."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu import flash_attention as pallas_flash
    from jax.sharding import PartitionSpec as P
    from torchax import interop

    rows = present(mesh, BATCH_AXES) or None
    heads = present(mesh, ("tensor",)) or None

    def per_device(q: Any, k: Any, v: Any, segments: Optional[Any]) -> Any:
        ids = pallas_flash.SegmentIds(q=segments, kv=segments) if segments is not None else None
        return pallas_flash.flash_attention(q, k, v, segment_ids=ids, causal=True,
                                            sm_scale=1.0 / math.sqrt(q.shape[-1]))

    def attend(q: Any, k: Any, v: Any, segments: Optional[Any]) -> Any:
        group = q.shape[1] // k.shape[1]  # grouped-query heads: each K/V head serves `group` query heads
        k, v = (jnp.repeat(t, group, axis=1) for t in (k, v))
        qkv = P(rows, heads, None, None)
        if segments is None:
            return jax.shard_map(lambda a, b, c: per_device(a, b, c, None), mesh=mesh, in_specs=(qkv,) * 3,
                                 out_specs=qkv, check_vma=False)(q, k, v)
        return jax.shard_map(per_device, mesh=mesh, in_specs=(qkv, qkv, qkv, P(rows, None)), out_specs=qkv,
                             check_vma=False)(q, k, v, segments.astype(jnp.int32))

    def attention_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     document_ids: Optional[torch.Tensor] = None, span: Optional[AttentionSpan] = None) -> torch.Tensor:
        # A local span (sliding window, chunks) runs the exact masked SDPA: the kernel here takes no span.
        if q.shape[2] % BLOCK or (span is not None and span.limits(q.shape[2])):
            return causal_attention(q, k, v, document_ids, span)
        return interop.call_jax(attend, q, k, v, document_ids)

    return attention_fn
