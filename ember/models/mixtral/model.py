"""Mixtral: the Llama decoder with a top-2 mixture of 8 SwiGLU experts in place of each feed-forward.

The skeleton, RoPE attention and RMSNorm are the shared ones (ember/nn/decoder.py), the MoE layer is
ember/nn/moe.py's with its default SwiGLU experts. No parallelism and no I/O here.
"""

from __future__ import annotations

from ember.models.mixtral.args import MixtralArgs
from ember.nn.decoder import Decoder, RMSNorm, TransformerBlock, num_params
from ember.nn.moe import MoE
from ember.nn.moe_stats import MoEOptions


class Transformer(Decoder):
    """tokens (B, T) -> logits (B, T, vocab_size): every block's feed-forward is a MoE layer."""

    def __init__(self, args: MixtralArgs, moe: MoEOptions = MoEOptions()):
        super().__init__(args, lambda i: TransformerBlock(i, args, MoE(args.dim, args.ffn_hidden_dim, args.n_experts,
                                                                      args.top_k, options=moe)),
                         lambda: RMSNorm(args.dim, args.norm_eps))


def flops_per_token(args: MixtralArgs, seq_len: int) -> float:
    """Training FLOPs per token with *active* parameters only: 6 N_active + 12 L H Q T (PaLM appendix B,
    with N counting the top_k experts a token passes through, not all E; the router's E x dim is included)."""
    attn = args.dim * args.head_dim * (2 * args.n_heads + 2 * args.kv_heads)
    experts = args.top_k * 3 * args.dim * args.ffn_hidden_dim
    router = args.dim * args.n_experts
    n = args.n_layers * (attn + experts + router + 2 * args.dim) + args.dim + args.vocab_size * args.dim
    return 6 * n + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len


__all__ = ["Transformer", "num_params", "flops_per_token"]
