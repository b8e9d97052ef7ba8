"""Llama 4 (text: Scout, Maverick) as plain single-device PyTorch, on the shared decoder (ember/nn/decoder.py).

What differs from Llama 3:
- iRoPE: three layers in four rotate q and k, attend within fixed chunks of 8192 positions and L2-normalise q and k
  (a weightless RMS norm; HF normalises after the rotation, ember before: a rotation keeps each vector's norm, so
  the two are the same function); every fourth layer has no rotary embedding and sees the whole causal context, its
  q scaled by a temperature that grows with the position (`_rope_at` hands those layers the factor in place of RoPE
  tables);
- the feed-forward is a mixture of experts in every layer (Scout) or every other one (Maverick): sigmoid scores
  choose the top-1 expert and scale its input, and a shared expert every token passes through is added
  (ember/nn/moe.py); the other layers are a wider dense SwiGLU.
No parallelism and no I/O here: hf.py maps Hugging Face weights, parallelize.py holds the tensor-parallel plan.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ember.models.llama4.args import Llama4Args
from ember.nn.decoder import Attention, Decoder, RMSNorm, TransformerBlock, num_params
from ember.nn.feed_forward import FeedForward
from ember.nn.flops import decoder_flops_per_token
from ember.nn.moe import MoE
from ember.nn.moe_stats import MoEOptions
from ember.nn.norm import WeightlessRMSNorm
from ember.nn.router import Router

__all__ = ["Transformer", "num_params", "flops_per_token"]


def _block(layer_id: int, args: Llama4Args, moe: MoEOptions) -> TransformerBlock:
    rope = args.uses_rope(layer_id)
    qk_norm = (lambda width: WeightlessRMSNorm(args.norm_eps)) if rope and args.qk_norm else None
    attention = Attention(args, qk_norm=qk_norm, span=args.layer_span(layer_id), rope=rope)
    ffn: nn.Module
    if args.is_moe_layer(layer_id):
        router = Router(args.dim, args.n_experts, args.top_k, norm_topk_prob=False, score_func="sigmoid")
        ffn = MoE(args.dim, args.moe_hidden_dim, args.n_experts, args.top_k, router=router,
                  shared_expert=FeedForward(args.dim, args.moe_hidden_dim), scale_input=True, options=moe)
    else:
        ffn = FeedForward(args.dim, args.ffn_hidden_dim)
    block = TransformerBlock(layer_id, args, ffn, attention)
    if not rope:
        block.rope_table = "_nope"  # the decoder passes (temperature, None) instead of RoPE's (cos, sin)
    return block


class Transformer(Decoder):
    """tokens (B, T) -> logits (B, T, vocab_size)."""

    def __init__(self, args: Llama4Args, moe: MoEOptions = MoEOptions()):
        super().__init__(args, lambda i: _block(i, args, moe), lambda: RMSNorm(args.dim, args.norm_eps))

    def _rope_at(self, positions: Optional[torch.Tensor], T: int, which: str) -> tuple[Optional[torch.Tensor], ...]:
        """RoPE rows as the Decoder's; for the NoPE layers ("_nope") each position's attention temperature,
        log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1, (T, 1) or (B, T, 1), with None for sin."""
        if which != "_nope":
            return super()._rope_at(positions, T, which)
        if not self.args.temperature_tuning:
            return None, None
        if positions is None:
            positions = torch.arange(T, device=self.rope_cos.device)
        scale = torch.log1p(torch.floor((positions.float() + 1.0) / self.args.floor_scale)) * self.args.attn_scale + 1.0
        return scale[..., None], None


def flops_per_token(args: Llama4Args, seq_len: int) -> float:
    """Training FLOPs per token: 6 N_active + 12 H Q sum over layers of T (PaLM appendix B), N counting the top_k
    routed experts and the shared expert a token passes through and the router, and the chunked layers the keys
    their chunks leave (nn/attention.py's scored_length)."""
    attn = args.dim * args.head_dim * (2 * args.n_heads + 2 * args.kv_heads)

    def layer_weights(layer: int) -> int:
        if args.is_moe_layer(layer):
            ffn = (args.top_k + 1) * 3 * args.dim * args.moe_hidden_dim + args.n_experts * args.dim
        else:
            ffn = 3 * args.dim * args.ffn_hidden_dim
        return attn + ffn + 2 * args.dim

    return decoder_flops_per_token(args, seq_len, layer_weights)
