"""The GPT-2/GPT-3 decoder as plain single-device PyTorch.

Learned absolute position embeddings added to the token embeddings, pre-LayerNorm blocks (LayerNorm
with bias before attention and MLP, one more after the last block: GPT-2, Radford et al. 2019, sec.
2.3; GPT-3 keeps it, Brown et al. 2020, sec. 2.1), multi-head attention and a GELU MLP, every linear
layer with a bias except the output projection, which shares the token embedding matrix. This is also
Pax's GPT (praxis TransformerLm with TrainablePositionalEmbedding, USE_BIAS, GELU approximate=True).
No parallelism and no I/O here: parallelize.py applies those from outside, hf.py maps GPT2LMHeadModel.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ember.models.gpt.args import GPTArgs
from ember.nn.attention import KVCache, causal_attention
from ember.nn.decoder import Decoder, num_params

__all__ = ["Transformer", "num_params", "flops_per_token"]


class Attention(nn.Module):
    def __init__(self, args: GPTArgs):
        super().__init__()
        self.head_dim = args.head_dim
        # Three projections rather than GPT-2's fused c_attn: tensor parallelism splits each by heads
        # (a fused matrix would hand a rank some of q's heads and some of k's). hf.py fuses them for export.
        self.wq = nn.Linear(args.dim, args.dim, bias=True)
        self.wk = nn.Linear(args.dim, args.dim, bias=True)
        self.wv = nn.Linear(args.dim, args.dim, bias=True)
        self.wo = nn.Linear(args.dim, args.dim, bias=True)
        # The attention kernel, (q, k, v, document_ids) -> out over (B, heads, T, head_dim); chosen by
        # nn/attention.set_attention_kernel (context parallelism's distributed form, ember/parallel/cp.py).
        self.attention_fn: Callable[..., torch.Tensor] = causal_attention
        self.kv_cache: Optional[KVCache] = None  # incremental decoding's (ember.generate, through use_kv_cache)

    def use_kv_cache(self, cache: Optional[KVCache]) -> None:
        """Decode incrementally into `cache` (None: back to whole-sequence attention)."""
        self.kv_cache = cache

    def forward(self, x: torch.Tensor, document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads, not n_heads: under tensor parallelism each rank holds n_heads / tp of them.
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, n_heads, T, head_dim)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, n_heads, T, head_dim)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, n_heads, T, head_dim)
        if self.kv_cache is not None:
            out = self.kv_cache.attend(q, k, v)  # (B, n_heads, T, head_dim), over every cached position
        else:
            out = self.attention_fn(q, k, v, document_ids)  # (B, n_heads, T, head_dim), scaled by 1/sqrt(head_dim)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))  # (B, T, n_heads * head_dim) -> (B, T, dim)

    def init_weights(self, std: float, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.normal_(linear.weight, mean=0.0, std=std)
            nn.init.zeros_(linear.bias)
        nn.init.normal_(self.wo.weight, mean=0.0, std=out_std)
        nn.init.zeros_(self.wo.bias)


class FeedForward(nn.Module):
    """w2(gelu(w1 x + b1)) + b2 with GELU's tanh approximation: GPT-2's `gelu_new` and Pax's GELU
    (approximate=True), so HF GPT-2 checkpoints give the same logits."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=True)
        self.w2 = nn.Linear(hidden_dim, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))  # (B, T, hidden) -> (B, T, dim)

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.w1.weight, mean=0.0, std=std)
        nn.init.normal_(self.w2.weight, mean=0.0, std=out_std)
        nn.init.zeros_(self.w1.bias)
        nn.init.zeros_(self.w2.bias)


class TransformerBlock(nn.Module):
    def __init__(self, args: GPTArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.attention_norm = nn.LayerNorm(args.dim, eps=args.norm_eps, bias=True)  # GPT-2's ln_1
        self.ffn_norm = nn.LayerNorm(args.dim, eps=args.norm_eps, bias=True)  # GPT-2's ln_2
        # The projections that write into the residual stream start 1/sqrt(2 n_layers) smaller (GPT-2
        # sec. 2.3; Megatron-LM's scaled_init_method), so the stream's variance does not grow with depth.
        # Pax's configs use one flat Gaussian instead; the scaled form is the common GPT-3 reproduction.
        self.std = args.init_std
        self.out_std = args.init_std / math.sqrt(2 * args.n_layers)

    def forward(self, x: torch.Tensor, document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), document_ids)  # (B, T, dim)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()  # weight 1, bias 0
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.std, self.out_std)
        self.feed_forward.init_weights(self.std, self.out_std)


class Transformer(Decoder):
    """tokens (B, T) -> logits (B, T, vocab_size): the shared Decoder with GPT blocks, LayerNorm, and a learned
    position table (GPT-2's wpe, the Decoder's pos_embeddings) instead of RoPE."""

    def __init__(self, args: GPTArgs):
        super().__init__(args, lambda i: TransformerBlock(args),  # no RoPE: GPTArgs.rope is None
                         lambda: nn.LayerNorm(args.dim, eps=args.norm_eps, bias=True))  # GPT-2's ln_f

    def init_embeddings(self) -> None:
        """Gaussian of std init_std (Pax's params_init, GPT-2's initializer_range) for both tables."""
        for table in (self.tok_embeddings, self.pos_embeddings):  # tok_embeddings: also the tied output
            if table is not None:
                nn.init.normal_(table.weight, std=self.args.init_std)

    def init_output(self) -> None:
        nn.init.normal_(self.output.weight, std=self.args.init_std)


def flops_per_token(args: GPTArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 N + 12 L H Q T (PaLM, Chowdhery et al. 2022, appendix B).

    6 N: forward (2) and backward (4) FLOPs per weight a token's activations are multiplied by. N is every
    parameter except the two lookups (token and position embeddings); a tied embedding stays in N once,
    as the output projection's weight, since that matmul runs whether or not the matrix is shared.
    Biases and norm gains are in N too, as a parameter count would have them. 12 L H Q T: the attention
    scores and weighted values (QK^T and AV), which no parameter counts.
    """
    attn = 4 * args.dim * args.dim + 4 * args.dim  # wq, wk, wv, wo and their biases
    ffn = 2 * args.dim * args.ffn_hidden_dim + args.ffn_hidden_dim + args.dim  # w1, w2 and biases
    norms = 2 * 2 * args.dim  # two LayerNorms, weight and bias
    n = args.n_layers * (attn + ffn + norms) + 2 * args.dim + args.vocab_size * args.dim  # + final norm, output
    return 6 * n + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
