"""Phi-3 as plain single-device PyTorch: the Llama block (ember/nn/decoder.py: RoPE attention with grouped-query
heads, RMSNorm, SwiGLU) with a sliding window on every layer (2,047 positions for the 4K models). Hugging Face
stores q, k and v as one fused `qkv_proj` and the SwiGLU's gate and up as one `gate_up_proj`; ember keeps them
apart (tensor parallelism splits each by heads or hidden units) and hf.py fuses them for export. No parallelism
and no I/O here."""

from __future__ import annotations

from typing import Optional

import torch

from ember.models.phi3.args import Phi3Args
from ember.nn.attention import scored_length
from ember.nn.decoder import Attention, Decoder, RMSNorm, TransformerBlock, num_params
from ember.nn.feed_forward import FeedForward
from ember.nn.rope import rope_cos_sin

__all__ = ["Transformer", "num_params", "flops_per_token"]


class Transformer(Decoder):
    """tokens (B, T) -> logits (B, T, vocab_size). With LongRoPE a second pair of RoPE tables, the long factors',
    serves every forward whose positions reach past rope_original_max_seq_len (Hugging Face's choice, made per
    forward from its largest position)."""

    def __init__(self, args: Phi3Args):
        super().__init__(args, lambda i: TransformerBlock(i, args, FeedForward(args.dim, args.ffn_hidden_dim),
                                                          Attention(args, span=args.layer_span(i))),
                         lambda: RMSNorm(args.dim, args.norm_eps))
        # ember.generate recomputes the cache when a sequence first reaches past it (as transformers does)
        long_rope = args.long_rope
        self.rope_switch_length = args.rope_original_max_seq_len if long_rope is not None else None
        if long_rope is not None:  # not persistent: derived from args, as the Decoder's own tables
            cos, sin = rope_cos_sin(long_rope)
            self.register_buffer("rope_long_cos", cos, persistent=False)
            self.register_buffer("rope_long_sin", sin, persistent=False)

    def _rope_at(self, positions: Optional[torch.Tensor], T: int, which: str) -> tuple[torch.Tensor, ...]:
        short = super()._rope_at(positions, T, which)
        if which or self.args.rope_long_factor is None:
            return short
        long = super()._rope_at(positions, T, "_long")
        if positions is None:
            return long if T > self.args.rope_original_max_seq_len else short
        beyond = positions.max() + 1 > self.args.rope_original_max_seq_len  # a tensor: no host sync
        return tuple(torch.where(beyond, a, b) for a, b in zip(long, short))

    @torch.no_grad()
    def init_rope(self, device: Optional[torch.device] = None) -> None:
        super().init_rope(device)
        long_rope = self.args.long_rope
        if long_rope is not None:
            self.rope_long_cos, self.rope_long_sin = rope_cos_sin(long_rope, device=device or self.rope_cos.device)


def flops_per_token(args: Phi3Args, seq_len: int) -> float:
    """Training FLOPs per token: 6 N + 12 L H Q T (PaLM appendix B), T counted as the sliding window leaves it
    (nn/attention.py's scored_length)."""
    attn = args.dim * args.head_dim * (2 * args.n_heads + 2 * args.kv_heads)
    n = (args.n_layers * (attn + 3 * args.dim * args.ffn_hidden_dim + 2 * args.dim) + args.dim
         + args.vocab_size * args.dim)
    return 6 * n + 12 * args.n_layers * args.n_heads * args.head_dim * scored_length(args.layer_span(0), seq_len)
