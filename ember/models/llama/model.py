"""The Llama 2 / 3 / 3.1 / 3.2 decoder as plain single-device PyTorch.

RMSNorm, rotary position embeddings (Meta's interleaved-pair convention, with the Llama 3.1 frequency
scaling), grouped-query attention through F.scaled_dot_product_attention, SwiGLU feed-forward.
No parallelism and no I/O here: `parallelize.py` applies those from outside, `hf.py` maps weights.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ember.models.llama.args import LlamaArgs


def rope_frequencies(args: LlamaArgs, device: Optional[torch.device] = None) -> torch.Tensor:
    """Rotations e^{i t w_k} for every position t < max_seq_len as (cos, sin): (max_seq_len, head_dim // 2, 2).

    Stored real, not complex: `model.to(dtype)` casts complex buffers to real, dropping the sines.
    """
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    if args.rope_scaling_factor is not None:
        inv_freq = _llama31_scaling(inv_freq, args)
    positions = torch.arange(args.max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    return torch.view_as_real(torch.polar(torch.ones_like(angles), angles))


def _llama31_scaling(inv_freq: torch.Tensor, args: LlamaArgs) -> torch.Tensor:
    # Llama 3.1 (Meta's `apply_scaling`): long wavelengths are slowed by `factor`, short ones kept,
    # and the band in between is interpolated smoothly, so 8k-trained weights extend to 128k.
    factor, low, high = args.rope_scaling_factor, args.rope_low_freq_factor, args.rope_high_freq_factor
    old_len = args.rope_original_max_seq_len
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_mid, interpolated, scaled)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x[2k], x[2k+1]) of x: (B, T, H, D) by freqs: (T, D // 2, 2)."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # (B, T, H, D/2) complex
    rotated = pairs * torch.view_as_complex(freqs.float())[None, :, None, :]
    return torch.view_as_real(rotated).flatten(3).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics even under bf16 autocast; the cast back keeps the activations' dtype.
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)  # (B, T, n_heads, head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)  # (B, T, n_kv_heads, head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, freqs), apply_rope(k, freqs)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, head_dim) for SDPA
        # enable_gqa lets SDPA share each K/V head across its query group without materialising
        # repeat_interleave copies (torch >= 2.5).
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))  # (B, T, dim)

    def init_weights(self, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=out_std)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, out_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w3.weight, mean=0.0, std=out_std)
        nn.init.trunc_normal_(self.w2.weight, mean=0.0, std=out_std)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: LlamaArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        # Depth-scaled init of the projections that write into the residual stream (GPT-2, torchtitan).
        self.out_std = 0.02 / math.sqrt(2 * (layer_id + 1))

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()
        self.attention.init_weights(self.out_std)
        self.feed_forward.init_weights(self.out_std)


class Transformer(nn.Module):
    """tokens (B, T) -> logits (B, T, vocab). Embedding, norm and output may be None (pipeline stages)."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings: Optional[nn.Embedding] = nn.Embedding(args.vocab_size, args.dim)
        # Layers keyed by their index: names stay stable when a pipeline stage holds only some of them.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm: Optional[RMSNorm] = RMSNorm(args.dim, args.norm_eps)
        self.output: Optional[nn.Linear] = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Not persistent: recomputed by init_weights, never stored in checkpoints.
        self.register_buffer("freqs", rope_frequencies(args), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens  # (B, T, dim)
        freqs = self.freqs[: h.shape[1]]
        for layer in self.layers.values():
            h = layer(h, freqs)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h  # (B, T, vocab)

    @torch.no_grad()
    def init_weights(self, buffer_device: Optional[torch.device] = None) -> None:
        """Fill every parameter and buffer; called after `to_empty` so a meta-built model gets real values."""
        device = buffer_device or (self.freqs.device if self.freqs.device.type != "meta" else None)
        self.freqs = rope_frequencies(self.args, device=device)
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            # `to_empty` from meta gives each module a new Parameter, which unties them: tie again.
            self.output.weight = self.tok_embeddings.weight
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, std=1.0 if not self.args.tie_embeddings else 0.02)
        for layer in self.layers.values():
            layer.init_weights()
        if self.norm is not None:
            self.norm.init_weights()
        if self.output is not None and not self.args.tie_embeddings:
            cutoff = 3 / math.sqrt(self.args.dim)
            nn.init.trunc_normal_(self.output.weight, std=self.args.dim**-0.5, a=-cutoff, b=cutoff)


def flops_per_token(args: LlamaArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 N + 12 L H Q T (PaLM, Chowdhery et al. 2022, appendix B).

    N counts every matmul weight a token passes through: the layers, the final norm and the output
    projection (also when it is tied to the embedding, since its matmul still runs); the input
    embedding is a lookup and is left out.
    """
    attn = args.dim * args.head_dim * (2 * args.n_heads + 2 * args.kv_heads)
    ffn = 3 * args.dim * args.ffn_hidden_dim
    per_layer = attn + ffn + 2 * args.dim
    n = args.n_layers * per_layer + args.dim + args.vocab_size * args.dim
    return 6 * n + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
