"""Mistral as plain single-device PyTorch: the Llama block (ember/nn/decoder.py: RoPE attention with
grouped-query heads, RMSNorm, SwiGLU) with sliding-window attention, where each query sees only the last
`sliding_window` positions (Mistral 7B v0.1). Every attention kernel, the KV cache and context parallelism
apply the window (ember/nn/attention.py's AttentionSpan). No parallelism and no I/O here."""

from __future__ import annotations

from ember.models.mistral.args import MistralArgs
from ember.nn.attention import scored_length
from ember.nn.decoder import Attention, Decoder, RMSNorm, TransformerBlock, num_params
from ember.nn.feed_forward import FeedForward

__all__ = ["Transformer", "num_params", "flops_per_token"]


class Transformer(Decoder):
    """tokens (B, T) -> logits (B, T, vocab_size)."""

    def __init__(self, args: MistralArgs):
        super().__init__(args, lambda i: TransformerBlock(i, args, FeedForward(args.dim, args.ffn_hidden_dim),
                                                          Attention(args, span=args.layer_span(i))),
                         lambda: RMSNorm(args.dim, args.norm_eps))


def flops_per_token(args: MistralArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 N + 12 L H Q T (PaLM appendix B), T counted as the sliding window leaves it
    (nn/attention.py's scored_length): the work a windowed kernel (flex attention) does."""
    attn = args.dim * args.head_dim * (2 * args.n_heads + 2 * args.kv_heads)
    n = (args.n_layers * (attn + 3 * args.dim * args.ffn_hidden_dim + 2 * args.dim) + args.dim
         + args.vocab_size * args.dim)
    return 6 * n + 12 * args.n_layers * args.n_heads * args.head_dim * scored_length(args.layer_span(0), seq_len)

