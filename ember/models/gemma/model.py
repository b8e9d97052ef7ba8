"""Gemma 3 (text) and Gemma 2 as plain single-device PyTorch, on the shared decoder (ember/nn/decoder.py).

What differs from Llama: the token embedding is scaled by sqrt(dim); RMSNorms gain (1 + w) in fp32
(ember/nn/norm.py); each block norms the input and the output of both attention and feed-forward (four norms);
the feed-forward is GeGLU with tanh-approximated GELU; q and k are RMS-normed over each head before RoPE and the
scores scaled by query_pre_attn_scalar ** -0.5; five local layers (a sliding window, RoPE base 10,000) alternate
with one global layer (the whole context, base 1,000,000 with linear scaling on 4B-27B). Gemma 2 on the same
block: local and global layers alternate on one RoPE base, no q/k norms, and the attention scores and the
logits are soft-capped (cap * tanh(x / cap)). No parallelism and no I/O here.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ember.models.gemma.args import GemmaArgs
from ember.nn.attention import scored_length
from ember.nn.decoder import Attention, Decoder, depth_scaled_std, num_params
from ember.nn.feed_forward import FeedForward
from ember.nn.norm import OffsetRMSNorm

__all__ = ["Transformer", "num_params", "flops_per_token"]


class Block(nn.Module):
    """h = x + post_attention_norm(attention(attention_norm(x))); out = h + post_ffn_norm(ffn(ffn_norm(h)))."""

    def __init__(self, layer_id: int, args: GemmaArgs):
        super().__init__()
        norm = functools.partial(OffsetRMSNorm, eps=args.norm_eps)
        self.attention = Attention(args, qk_norm=norm if args.qk_norm else None, span=args.layer_span(layer_id),
                                   score_scale=args.query_pre_attn_scalar ** -0.5, softcap=args.attn_softcap)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim, functools.partial(F.gelu, approximate="tanh"))
        self.attention_norm, self.post_attention_norm = norm(args.dim), norm(args.dim)
        self.ffn_norm, self.post_ffn_norm = norm(args.dim), norm(args.dim)
        # the Decoder passes the local layers' own RoPE tables (Gemma 3; Gemma 2's layers share one base)
        self.rope_table = "_local" if not args.is_global(layer_id) and args.local_rope_theta is not None else ""
        self.out_std = depth_scaled_std(layer_id)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = x + self.post_attention_norm(self.attention(self.attention_norm(x), cos, sin, document_ids))
        return h + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h)))

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.post_attention_norm, self.ffn_norm, self.post_ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.out_std)
        self.feed_forward.init_weights(self.out_std)


class Transformer(Decoder):
    """tokens (B, T) -> logits (B, T, vocab_size)."""

    def __init__(self, args: GemmaArgs):
        super().__init__(args, lambda i: Block(i, args), lambda: OffsetRMSNorm(args.dim, args.norm_eps),
                         logit_softcap=args.final_softcap)

    def embed(self, tokens: torch.Tensor, positions: Optional[torch.Tensor]) -> torch.Tensor:
        h = super().embed(tokens, positions)
        if self.tok_embeddings is None:
            return h  # a later pipeline stage: hidden states already
        # sqrt(dim) rounded to the weights' dtype first, as Gemma's reference multiplies
        return h * torch.tensor(math.sqrt(self.args.dim), dtype=h.dtype)


def flops_per_token(args: GemmaArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 N + 12 H Q sum over layers of T (PaLM appendix B), local layers counting the
    keys their window leaves (nn/attention.py's scored_length)."""
    attn = args.dim * args.head_dim * (2 * args.n_heads + 2 * args.kv_heads) + 2 * args.head_dim * args.qk_norm
    n = (args.n_layers * (attn + 3 * args.dim * args.ffn_hidden_dim + 4 * args.dim) + args.dim
         + args.vocab_size * args.dim)
    scored = sum(scored_length(args.layer_span(i), seq_len) for i in range(args.n_layers))
    return 6 * n + 12 * args.n_heads * args.head_dim * scored
