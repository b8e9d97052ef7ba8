"""Mixtral: the Llama decoder with a top-2 mixture of 8 SwiGLU experts in place of each feed-forward.

Attention, RMSNorm and RoPE are the Llama family's own (imported, not re-implemented); the MoE layer is
ember/nn/moe.py. No parallelism and no I/O here.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ember.models.llama.model import Attention, RMSNorm, rope_cos_sin
from ember.models.mixtral.args import MixtralArgs
from ember.nn.moe import MoE


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: MixtralArgs):
        super().__init__()
        self.attention = Attention(args)  # type: ignore[arg-type]  # duck-typed args: same fields
        self.moe = MoE(args.dim, args.ffn_hidden_dim, args.n_experts, args.top_k)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.out_std = 0.02 / math.sqrt(2 * (layer_id + 1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, document_ids)  # (B, T, dim)
        return h + self.moe(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()
        self.attention.init_weights(self.out_std)
        self.moe.init_weights(self.out_std)


class Transformer(nn.Module):
    """tokens (B, T) -> logits (B, T, vocab_size); pipeline stages may drop embedding, norm or output."""

    def __init__(self, args: MixtralArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings: Optional[nn.Embedding] = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm: Optional[RMSNorm] = RMSNorm(args.dim, args.norm_eps)
        self.output: Optional[nn.Linear] = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.output_chunks = 1  # > 1: logits as a list of sequence chunks (see the Llama model)
        cos, sin = rope_cos_sin(args)  # type: ignore[arg-type]
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, positions: Optional[torch.Tensor] = None,
                document_ids: Optional[torch.Tensor] = None) -> torch.Tensor | list[torch.Tensor]:
        T = tokens.shape[1]
        if positions is None:
            if T > self.rope_cos.shape[0]:
                raise ValueError(f"sequence length {T} exceeds max_seq_len={self.rope_cos.shape[0]}")
            cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens  # (B, T, dim)
        for layer in self.layers.values():
            h = layer(h, cos, sin, document_ids)
        h = self.norm(h) if self.norm is not None else h
        if self.output is None:
            return h
        if self.output_chunks > 1:
            return [self.output(chunk) for chunk in h.tensor_split(self.output_chunks, dim=1)]
        return self.output(h)  # (B, T, vocab_size)

    def moe_layers(self) -> list[MoE]:
        return [layer.moe for layer in self.layers.values()]

    def tie_weights(self) -> None:
        """Mixtral does not tie its embeddings; kept for the interface every family shares."""

    @torch.no_grad()
    def init_rope(self, device: Optional[torch.device] = None) -> None:
        cos, sin = rope_cos_sin(self.args, device=device or self.rope_cos.device)  # type: ignore[arg-type]
        self.rope_cos, self.rope_sin = cos, sin

    @torch.no_grad()
    def init_weights(self, buffer_device: Optional[torch.device] = None) -> None:
        self.init_rope(buffer_device)
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, std=1.0)
        for layer in self.layers.values():
            layer.init_weights()
        if self.norm is not None:
            self.norm.init_weights()
        if self.output is not None:
            std = self.args.dim**-0.5
            nn.init.trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std)


def num_params(model: nn.Module, active: bool = False) -> int:
    """Parameters; active=True counts only top_k of each layer's experts (what one token uses)."""
    total = sum(p.numel() for p in model.parameters())
    if not active:
        return total
    args = model.args
    per_expert = 3 * args.dim * args.ffn_hidden_dim
    return total - args.n_layers * (args.n_experts - args.top_k) * per_expert


def flops_per_token(args: MixtralArgs, seq_len: int) -> float:
    """Training FLOPs per token with *active* parameters only: 6 N_active + 12 L H Q T (PaLM appendix B,
    with N counting the top_k experts a token passes through, not all E; the router's E x dim is included)."""
    attn = args.dim * args.head_dim * (2 * args.n_heads + 2 * args.kv_heads)
    experts = args.top_k * 3 * args.dim * args.ffn_hidden_dim
    router = args.dim * args.n_experts
    n = args.n_layers * (attn + experts + router + 2 * args.dim) + args.dim + args.vocab_size * args.dim
    return 6 * n + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len


__all__ = ["Transformer", "num_params", "flops_per_token"]
