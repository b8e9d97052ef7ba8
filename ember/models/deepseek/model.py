"""DeepSeek-V3 (and V2) on the shared decoder: pre-norm blocks of Multi-head Latent Attention (ember/nn/mla.py, with
YaRN RoPE on the rope part of each head) and, from layer n_dense_layers on, a mixture of experts with shared experts
(ember/nn/moe.py: V3's group-limited sigmoid router with its aux-loss-free score bias, V2's softmax router), a dense
SwiGLU before. Multi-token prediction is not built (transformers' class does not run it either). No parallelism and
no I/O here: parallelize.py holds the tensor-parallel plan, hf.py maps Hugging Face weights.
"""

from __future__ import annotations

from torch import nn

from ember.models.deepseek.args import DeepseekArgs
from ember.nn.decoder import Decoder, RMSNorm, TransformerBlock, num_params
from ember.nn.feed_forward import FeedForward
from ember.nn.mla import MLA
from ember.nn.moe import MoE
from ember.nn.moe_stats import MoEOptions
from ember.nn.router import Router

__all__ = ["Transformer", "num_params", "flops_per_token"]


def _attention(args: DeepseekArgs) -> MLA:
    return MLA(args.dim, args.n_heads, q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank,
               qk_nope_head_dim=args.qk_nope_head_dim, qk_rope_head_dim=args.qk_rope_head_dim,
               v_head_dim=args.v_head_dim, softmax_scale_factor=args.softmax_scale_factor)


def _block(layer_id: int, args: DeepseekArgs, moe: MoEOptions) -> TransformerBlock:
    ffn: nn.Module
    if args.is_moe_layer(layer_id):
        router = Router(args.dim, args.n_experts, args.top_k, args.norm_topk_prob, score_func=args.score_func,
                        n_groups=args.n_groups, topk_groups=args.topk_groups, route_scale=args.route_scale,
                        score_bias=args.score_bias)
        shared = FeedForward(args.dim, args.n_shared_experts * args.moe_hidden_dim) if args.n_shared_experts else None
        ffn = MoE(args.dim, args.moe_hidden_dim, args.n_experts, args.top_k, router=router, shared_expert=shared,
                  options=moe)
    else:
        ffn = FeedForward(args.dim, args.ffn_hidden_dim)
    return TransformerBlock(layer_id, args, ffn, attention=_attention(args))


class Transformer(Decoder):
    """tokens (B, T) -> logits (B, T, vocab_size): the shared Decoder with DeepSeek blocks and RMSNorm."""

    def __init__(self, args: DeepseekArgs, moe: MoEOptions = MoEOptions()):
        super().__init__(args, lambda i: _block(i, args, moe), lambda: RMSNorm(args.dim, args.norm_eps))


def _attention_params(args: DeepseekArgs) -> int:
    """The weights a token's attention multiplies by (MLA's projections and its two latent norms)."""
    q_out = args.n_heads * args.head_dim
    q = args.dim * q_out if not args.q_lora_rank else args.dim * args.q_lora_rank + args.q_lora_rank * (q_out + 1)
    kv = args.dim * (args.kv_lora_rank + args.qk_rope_head_dim) + args.kv_lora_rank
    kv += args.kv_lora_rank * args.n_heads * (args.qk_nope_head_dim + args.v_head_dim)
    return q + kv + args.n_heads * args.v_head_dim * args.dim


def flops_per_token(args: DeepseekArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 N_active + the attention scores' and outputs' 6 L H T (d_qk + d_v) (PaLM appendix
    B's 12 L H Q T with the key width d_qk = nope + rope and the value width d_v, which MLA sets apart; N counts each
    weight a token is multiplied by: its top_k routed experts, the shared ones and the router, not the embedding)."""
    n = 0
    for layer in range(args.n_layers):
        if args.is_moe_layer(layer):
            experts = args.top_k + args.n_shared_experts
            ffn = experts * 3 * args.dim * args.moe_hidden_dim + args.n_experts * args.dim
        else:
            ffn = 3 * args.dim * args.ffn_hidden_dim
        n += _attention_params(args) + ffn + 2 * args.dim
    n += args.dim + args.vocab_size * args.dim  # final norm, output projection
    return 6 * n + 6 * args.n_layers * args.n_heads * (args.head_dim + args.v_head_dim) * seq_len
