"""Attention kernels shared by the model families: causal, and causal within documents.

Every kernel takes q: (B, n_heads, T, head_dim), k and v: (B, n_kv_heads, T, head_dim), and optionally
document_ids: (B, T), the index of the packed document each token belongs to; with them a token
attends only to earlier tokens of its own document (block-causal), so packed documents do not see
each other.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def document_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids -> (B, 1, T, T) bool, True where query i may attend to key j: j <= i, same document."""
    T = document_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=document_ids.device).tril()
    same = document_ids[:, :, None] == document_ids[:, None, :]  # (B, T, T)
    return (same & causal)[:, None]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """SDPA, causal; block-causal through an explicit mask when document_ids are given (the CPU path:
    flex attention has no CPU backward in torch 2.13)."""
    # enable_gqa shares each K/V head with its group of query heads inside SDPA, rather than copying K/V
    # per query head (repeat_interleave): less memory traffic, and faster on CPU as on GPU.
    gqa = q.shape[1] != k.shape[1]
    if document_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(document_ids), enable_gqa=gqa)


class KVCache:
    """Keys and values of every position generated so far, preallocated for the whole generation (B, n_kv_heads,
    max_len, head_dim), so decoding never reallocates (gpt-fast's static cache). Before each forward the caller
    calls `set_positions(slots, pad)`: slots (T,) are the cache positions of the tokens going in, pad (B,) how
    many slots at the start of each row are left padding (prompts of different lengths share one batch,
    right-aligned).
    A plain object, not a module: it is no part of the model's state."""

    def __init__(self, batch: int, kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.k = torch.zeros(batch, kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.slots = torch.zeros(0, dtype=torch.long, device=device)
        self.pad = torch.zeros(batch, dtype=torch.long, device=device)
        self.end = 0  # slots[-1] + 1, as a Python int
        self.padded = False  # whether any row has left padding
        # True: always attend over the whole preallocated length with a mask, so every decode step has the same
        # shapes (a compiled decode step then compiles once instead of once per length).
        self.static = False

    def set_positions(self, slots: torch.Tensor, pad: torch.Tensor) -> None:
        self.slots, self.pad = slots, pad
        self.end, self.padded = int(slots[-1]) + 1, bool(pad.any())

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write this step's k, v (B, n_kv_heads, T, head_dim) at `slots`, and attend q (B, n_heads, T, head_dim)
        over every cached key at or before each query's slot, past the row's padding."""
        self.k.index_copy_(2, self.slots, k.to(self.k.dtype))
        self.v.index_copy_(2, self.slots, v.to(self.v.dtype))
        gqa = q.shape[1] != k.shape[1]
        if not self.static and not self.padded and q.shape[2] == self.end:  # a prefill from empty: plain causal
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        if not self.static and not self.padded and q.shape[2] == 1:  # one new token: every position so far
            k_all, v_all = self.k[:, :, :self.end].to(q.dtype), self.v[:, :, :self.end].to(q.dtype)
            return F.scaled_dot_product_attention(q, k_all, v_all, enable_gqa=gqa)
        key = torch.arange(self.k.shape[2], device=q.device)  # (L,)
        causal = key[None, :] <= self.slots[:, None]  # (T, L)
        real = key[None, :] >= self.pad[:, None]  # (B, L): not left padding
        # A padding query may see itself, so its (discarded) row stays finite rather than NaN.
        mask = (causal[None] & real[:, None, :]) | (key[None, :] == self.slots[:, None])[None]  # (B, T, L)
        return F.scaled_dot_product_attention(q, self.k.to(q.dtype), self.v.to(q.dtype), attn_mask=mask[:, None],
                                              enable_gqa=gqa)


class FlexDocumentAttention:
    """Block-causal attention with flex attention's sparse BlockMask (CUDA): fully masked blocks are
    skipped instead of computed and discarded. The mask is built once per batch and reused by every
    layer (keyed by the document_ids tensor itself)."""

    def __init__(self) -> None:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        self._create_block_mask = create_block_mask
        self._flex = torch.compile(flex_attention)  # flex attention is only fast compiled
        self._key: Optional[torch.Tensor] = None
        self._mask = None

    def _block_mask(self, document_ids: torch.Tensor):
        if self._key is not document_ids:
            def same_document_causal(b, h, q_idx, kv_idx):
                return (q_idx >= kv_idx) & (document_ids[b, q_idx] == document_ids[b, kv_idx])

            B, T = document_ids.shape
            self._mask = self._create_block_mask(same_document_causal, B, None, T, T, device=document_ids.device)
            self._key = document_ids
        return self._mask

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        if document_ids is None:
            return causal_attention(q, k, v)
        return self._flex(q, k, v, block_mask=self._block_mask(document_ids), enable_gqa=q.shape[1] != k.shape[1])


def document_layout(tokens: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed tokens (B, T) -> (document_ids, positions), each (B, T). A document ends with its EOS, so
    the token after an EOS starts the next document; positions count from 0 within each document."""
    is_eos = (tokens == eos_id).long()
    document_ids = torch.cumsum(is_eos, dim=1) - is_eos  # EOS tokens before this one
    index = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    starts_doc = torch.ones_like(is_eos, dtype=torch.bool)
    starts_doc[:, 1:] = is_eos[:, :-1].bool()
    start = torch.cummax(torch.where(starts_doc, index, torch.zeros_like(index)), dim=1).values
    return document_ids, index - start
