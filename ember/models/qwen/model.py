"""Qwen2/2.5, Qwen3 and Qwen3-MoE as plain single-device PyTorch.

The Llama block on the shared decoder (ember/nn/decoder.py: RoPE attention with grouped-query heads,
RMSNorm, SwiGLU), with what Qwen adds: biases on the q/k/v projections (Qwen2), an RMSNorm over each head's
width on q and k before RoPE (Qwen3), heads wider than dim / n_heads (Qwen3 0.6B-4B, 32B), sliding windows on
the upper layers where a config turns them on, and for Qwen3-MoE a top-k softmax router over 128 SwiGLU
experts in place of the feed-forward (ember/nn/moe.py; no shared expert). No parallelism and no I/O here:
parallelize.py holds the tensor-parallel plan, hf.py maps Hugging Face weights.
"""

from __future__ import annotations

from torch import nn

from ember.models.qwen.args import QwenArgs
from ember.nn.decoder import Attention, Decoder, RMSNorm, TransformerBlock, num_params
from ember.nn.feed_forward import FeedForward
from ember.nn.flops import decoder_flops_per_token
from ember.nn.moe import MoE
from ember.nn.moe_stats import MoEOptions

__all__ = ["Transformer", "num_params", "flops_per_token"]


def _block(layer_id: int, args: QwenArgs, moe: MoEOptions) -> TransformerBlock:
    qk_norm = (lambda width: RMSNorm(width, args.norm_eps)) if args.qk_norm else None
    attention = Attention(args, qkv_bias=args.qkv_bias, qk_norm=qk_norm, span=args.layer_span(layer_id))
    ffn: nn.Module
    if args.is_moe_layer(layer_id):
        ffn = MoE(args.dim, args.moe_hidden_dim, args.n_experts, args.top_k, norm_topk_prob=args.norm_topk_prob,
                  options=moe)
    else:
        ffn = FeedForward(args.dim, args.ffn_hidden_dim)
    return TransformerBlock(layer_id, args, ffn, attention)


class Transformer(Decoder):
    """tokens (B, T) -> logits (B, T, vocab_size): the shared Decoder with Qwen blocks and RMSNorm."""

    def __init__(self, args: QwenArgs, moe: MoEOptions = MoEOptions()):
        super().__init__(args, lambda i: _block(i, args, moe), lambda: RMSNorm(args.dim, args.norm_eps))


def flops_per_token(args: QwenArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 N_active + 12 L H Q T (PaLM appendix B; N counts each weight a token is
    multiplied by: the top_k experts it is routed to, not all of them, and the router; not the embedding lookup).
    Biases and norms are counted, as their elementwise work is a FLOP per weight too. Sliding-window layers count
    the keys their window leaves (nn/attention.py's scored_length)."""
    attn = args.dim * args.head_dim * (2 * args.n_heads + 2 * args.kv_heads)
    attn += (args.n_heads + 2 * args.kv_heads) * args.head_dim * args.qkv_bias + 2 * args.head_dim * args.qk_norm

    def layer_weights(layer: int) -> int:
        if args.is_moe_layer(layer):
            ffn = args.top_k * 3 * args.dim * args.moe_hidden_dim + args.n_experts * args.dim
        else:
            ffn = 3 * args.dim * args.ffn_hidden_dim
        return attn + ffn + 2 * args.dim

    return decoder_flops_per_token(args, seq_len, layer_weights)
