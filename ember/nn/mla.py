"""Multi-head Latent Attention (DeepSeek-V2, arXiv:2405.04434 section 2.1; DeepSeek-V3), and its latent KV cache.

Keys and values come from one compressed latent per token: c_kv = RMSNorm(x W_kv_a[:kv_lora_rank]) (kv_lora_rank
wide), expanded per head by W_kv_b into a "nope" key part (qk_nope_head_dim) and a value (v_head_dim). Position
enters through a decoupled RoPE key k_rope = RoPE(x W_kv_a[kv_lora_rank:]) (qk_rope_head_dim), one head shared by
every query head; each query head is [q_nope, RoPE(q_rope)], from x directly (q_lora_rank None: V2-Lite) or through
its own low-rank latent with an RMSNorm (V3). RoPE is ember's consecutive-pair convention (nn/decoder.py).

Training runs the expanded form through `attention_fn`, the kernel Attention has (q, k: (B, heads, T, nope + rope),
v: (B, heads, T, v_head_dim)), so context parallelism and flex attention swap it the same way. Generation caches
only c_kv and k_rope (`LatentKVCache`: kv_lora_rank + qk_rope_head_dim numbers per token, not 2 x heads x head_dim)
and attends in the absorbed form: q_nope through W_kv_b's key rows against the latent, the output through its value
rows (the paper's appendix; DeepSeek's inference code `attn_impl="absorb"`).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from ember.nn.attention import causal_attention
from ember.nn.decoder import RMSNorm
from ember.nn.rope import apply_rope


class MLA(nn.Module):
    """(B, T, dim) -> (B, T, dim). softmax_scale_factor multiplies the softmax scale (qk_head_dim ** -0.5): YaRN's
    mscale(factor, mscale_all_dim) ** 2 (nn/yarn.py). latent_eps: the q/kv latent norms' epsilon (transformers'
    DeepSeek builds them with its default 1e-6 whatever rms_norm_eps says)."""

    def __init__(self, dim: int, n_heads: int, *, q_lora_rank: Optional[int], kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, softmax_scale_factor: float = 1.0,
                 latent_eps: float = 1e-6):
        super().__init__()
        self.n_heads, self.q_lora_rank, self.kv_lora_rank = n_heads, q_lora_rank or None, kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        if self.q_lora_rank is None:
            self.wq: Optional[nn.Linear] = nn.Linear(dim, n_heads * self.qk_head_dim, bias=False)
            self.wq_a = self.q_norm = self.wq_b = None
        else:
            self.wq = None
            self.wq_a = nn.Linear(dim, self.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(self.q_lora_rank, latent_eps)
            self.wq_b = nn.Linear(self.q_lora_rank, n_heads * self.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(kv_lora_rank, latent_eps)
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=False)
        # The kernels scale by qk_head_dim ** -0.5; q carries the rest, as Attention's score_scale does.
        self.q_factor = softmax_scale_factor if softmax_scale_factor != 1.0 else None
        self.softmax_scale = self.qk_head_dim**-0.5 * softmax_scale_factor
        self.span = None  # DeepSeek attends to the whole causal context; the kernels' span argument
        # The attention kernel, (q, k, v, document_ids, span) -> out over (B, heads, T, head_dim), v's head_dim
        # v_head_dim; chosen by nn/attention.set_attention_kernel, as Attention's is.
        self.attention_fn: Callable[..., torch.Tensor] = causal_attention
        self.kv_cache: Optional[LatentKVCache] = None  # incremental decoding's (ember.generate: use_kv_cache)

    def use_kv_cache(self, cache: Optional[LatentKVCache]) -> None:
        """Decode incrementally into `cache` (None: back to whole-sequence attention)."""
        self.kv_cache = cache

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        # -1 heads, not n_heads: under tensor parallelism each rank holds n_heads / tp of them.
        q_nope, q_rope = q.view(B, T, -1, self.qk_head_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        c_kv = self.kv_norm(c_kv)  # (B, T, kv_lora_rank)
        q_rope = apply_rope(q_rope, cos, sin)  # (B, T, heads, rope)
        k_rope = apply_rope(k_rope[:, :, None], cos, sin)  # (B, T, 1, rope): one head shared by all
        if self.kv_cache is not None:
            out = self.kv_cache.attend(q_nope, q_rope, c_kv, k_rope[:, :, 0], self._kv_b_weight(),
                                       self.softmax_scale)  # (B, T, heads, v)
            return self.wo(out.reshape(B, T, -1))
        kv = self.wkv_b(c_kv).view(B, T, -1, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)  # (B, T, heads, nope), (B, T, heads, v)
        heads = k_nope.shape[2]
        q = torch.cat([q_nope, q_rope], dim=-1)  # (B, T, heads, qk_head_dim)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, heads, -1)], dim=-1)
        if self.q_factor is not None:
            q = q * self.q_factor
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, *), the layout SDPA takes
        out = self.attention_fn(q, k, v, document_ids, self.span)  # (B, heads, T, v_head_dim)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))  # (B, T, heads * v) -> (B, T, dim)

    def _kv_b_weight(self) -> torch.Tensor:
        """wkv_b's weight as (heads, nope + v, kv_lora_rank): this rank's heads under tensor parallelism."""
        weight = self.wkv_b.weight
        weight = weight.to_local() if hasattr(weight, "to_local") else weight
        return weight.view(-1, self.nope_dim + self.v_dim, self.kv_lora_rank)

    def make_kv_cache(self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device) -> LatentKVCache:
        """The cache ember.generate attaches: the latent and the rotated k_rope, for `batch` rows of `max_len`."""
        return LatentKVCache(batch, max_len, self.kv_lora_rank, self.rope_dim, dtype, device)

    def init_weights(self, out_std: float) -> None:
        for linear in (self.wq, self.wq_a, self.wq_b, self.wkv_a, self.wkv_b):
            if linear is not None:
                nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=out_std)
        for norm in (self.q_norm, self.kv_norm):
            if norm is not None:
                norm.reset_parameters()


class LatentKVCache:
    """MLA's cache for generation: the normalised latent c_kv (B, max_len, kv_lora_rank) and the rotated shared key
    k_rope (B, max_len, qk_rope_head_dim) of every position so far, preallocated. The protocol is KVCache's
    (nn/attention.py): `set_positions(slots, pad)` before each forward, left padding masked, `static` for one set of
    shapes at every step (a compiled decode step). A plain object, not a module: no part of the model's state."""

    def __init__(self, batch: int, max_len: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.c_kv = torch.zeros(batch, max_len, kv_lora_rank, dtype=dtype, device=device)
        self.k_rope = torch.zeros(batch, max_len, rope_dim, dtype=dtype, device=device)
        self.slots = torch.zeros(0, dtype=torch.long, device=device)
        self.pad = torch.zeros(batch, dtype=torch.long, device=device)
        self.end = 0  # slots[-1] + 1, as a Python int
        self.static = False

    def set_positions(self, slots: torch.Tensor, pad: torch.Tensor, end: Optional[int] = None,
                      padded: Optional[bool] = None) -> None:
        self.slots, self.pad = slots, pad
        self.end = int(slots[-1]) + 1 if end is None else end  # the caller's Python int saves a device sync

    def attend(self, q_nope: torch.Tensor, q_rope: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor,
               kv_b: torch.Tensor, scale: float) -> torch.Tensor:
        """Write this step's c_kv (B, T, kv_lora_rank) and k_rope (B, T, rope) at `slots`; attend q_nope
        (B, T, heads, nope) and q_rope (B, T, heads, rope) over every cached position at or before each query's
        slot, past the row's padding. kv_b: (heads, nope + v, kv_lora_rank). -> (B, T, heads, v_head_dim)."""
        self.c_kv.index_copy_(1, self.slots, c_kv.to(self.c_kv.dtype))
        self.k_rope.index_copy_(1, self.slots, k_rope.to(self.k_rope.dtype))
        length = self.c_kv.shape[1] if self.static else self.end
        latent = self.c_kv[:, :length].to(q_nope.dtype)  # (B, L, kv_lora_rank)
        rope = self.k_rope[:, :length].to(q_nope.dtype)  # (B, L, rope)
        nope_dim = q_nope.shape[-1]
        w_k, w_v = kv_b[:, :nope_dim].to(q_nope.dtype), kv_b[:, nope_dim:].to(q_nope.dtype)
        # Absorbed: q_nope . (W_k c) = (W_k^T q_nope) . c, so the nope scores are taken against the latent itself.
        q_latent = torch.einsum("bthd,hdl->bthl", q_nope, w_k)  # (B, T, heads, kv_lora_rank)
        scores = torch.einsum("bthl,bsl->bhts", q_latent, latent) + torch.einsum("bthr,bsr->bhts", q_rope, rope)
        key = torch.arange(length, device=q_nope.device)  # (L,)
        causal = key[None, :] <= self.slots[:, None]  # (T, L)
        real = key[None, :] >= self.pad[:, None]  # (B, L): not left padding
        # A padding query may see itself, so its (discarded) row stays finite rather than NaN.
        mask = (causal[None] & real[:, None, :]) | (key[None, :] == self.slots[:, None])[None]  # (B, T, L)
        scores = (scores.float() * scale).masked_fill(~mask[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q_nope.dtype)  # (B, heads, T, L)
        out_latent = torch.einsum("bhts,bsl->bthl", probs, latent)  # (B, T, heads, kv_lora_rank)
        return torch.einsum("bthl,hvl->bthv", out_latent, w_v)  # (B, T, heads, v_head_dim)

