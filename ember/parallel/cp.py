"""Context parallelism: each rank holds a slice of every sequence.

Load balance: the sequence is cut into 2 x cp chunks and rank r keeps chunks r and 2cp-1-r (head-tail),
so under a causal mask every rank has the same amount of attention work.

Two attention forms:
- `allgather` (torchprime's and MaxText's): each rank keeps its queries, all-gathers the keys and values
  with an autograd-aware collective (whose backward reduce-scatters their gradients) and masks by the
  true positions. K/V memory grows with the full sequence, but it runs anywhere, CPU/gloo included.
- `ring`: PyTorch's `context_parallel` (ring attention inside SDPA, K/V passed around the ring). It
  needs SDPA's flash/efficient kernels, i.e. CUDA; torch 2.13's CPU SDPA has no sharding strategy.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from ember.nn.attention import AttentionSpan, set_attention_kernel

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def headtail_positions(seq_len: int, cp: int, rank: int,
                       device: Optional[Union[torch.device, str]] = None) -> torch.Tensor:
    """The positions rank `rank` of `cp` holds: chunks rank and 2cp-1-rank of 2cp equal chunks. (seq_len // cp,)"""
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, last])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's head-tail slice of x along `dim` (the sequence)."""
    return x.index_select(dim, headtail_positions(x.shape[dim], cp, rank, x.device))


class AllGatherKVAttention:
    """Causal attention of local queries over the keys/values of the whole sequence, gathered from the
    context-parallel group; the mask compares true positions, so the head-tail layout is exact, local spans
    (sliding windows, chunks) included."""

    def __init__(self, cp_mesh: DeviceMesh):
        self.mesh = cp_mesh
        self.cp = cp_mesh.size()
        self.rank = cp_mesh.get_local_rank()

    def _mask(self, local_len: int, device: torch.device, span: Optional[AttentionSpan]) -> torch.Tensor:
        seq_len = local_len * self.cp
        q_pos = headtail_positions(seq_len, self.cp, self.rank, device)[:, None]  # (T / cp, 1)
        # in gather order
        k_pos = torch.cat([headtail_positions(seq_len, self.cp, r, device) for r in range(self.cp)])[None, :]
        return span.mask(q_pos, k_pos) if span is not None else q_pos >= k_pos  # (T / cp, T): True where seen

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 document_ids: Optional[torch.Tensor] = None, span: Optional[AttentionSpan] = None) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_gather_tensor_autograd

        assert document_ids is None, "document masking with context parallelism is refused at config time"
        # (B, n_kv_heads, T / cp, head_dim) -> (B, n_kv_heads, T, head_dim), ranks' slices in rank order
        k_all = all_gather_tensor_autograd(k.contiguous(), gather_dim=2, group=self.mesh)
        v_all = all_gather_tensor_autograd(v.contiguous(), gather_dim=2, group=self.mesh)
        mask = self._mask(q.shape[2], q.device, span)
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def _repeat_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: Optional[torch.Tensor] = None,
                         span: Optional[AttentionSpan] = None) -> torch.Tensor:
    assert span is None, "local attention spans with ring attention are refused at config time"
    # Ring attention shards SDPA's plain (B, H, T, D) form; GQA K/V heads are expanded first.
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, impl: str) -> None:
    """Swap each block's attention kernel for its context-parallel form ("allgather" or "ring")."""
    set_attention_kernel(model, AllGatherKVAttention(cp_mesh) if impl == "allgather" else _repeat_kv_attention)


@contextlib.contextmanager
def ring_context(cp_mesh: DeviceMesh, buffers: list[torch.Tensor], seq_dims: list[int], keep: set) -> Iterator[None]:
    """torch's context_parallel around one forward+backward: shards `buffers` in place along `seq_dims`
    (its own head-tail load balancing) and routes SDPA through ring attention. CUDA only."""
    from torch.distributed.tensor.experimental import context_parallel

    with context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=seq_dims, no_restore_buffers=keep):
        yield
