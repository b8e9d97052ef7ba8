"""GLaM: a decoder whose layers alternate a mixture-of-experts FFN and a dense gated-GELU FFN.

Du et al. 2022, "GLaM: Efficient Scaling of Language Models with Mixture-of-Experts" (sec. 3), as Pax builds
it (praxis/layers/glam.py: GlamUniTransformerLmHParams / GlamStackedTransformerHParams):
- every other layer's FFN is a top-2 MoE, the first of each pair (layers 0, 2, 4, ...; args.moe_every);
- the dense layers' FFN is a gated linear unit with GELU: w2(gelu(w1 x) * w3 x) (the paper's "non-MoE
  Transformer feed-forward sub-layers"; praxis GELU is the tanh approximation);
- each expert is a plain two-matrix FFN, w2(relu(w1 x)): praxis' GLaM sets the gated GELU on the dense
  template only, so its TransformerFeedForwardMoe keeps its defaults (ReLU, use_gated_activation=False).
  The published sizes count two matrices per expert (64B/64E: 96.6B active of 1.2T only adds up so);
- RMSNorm without bias before attention and FFN and after the last layer; no bias anywhere;
- the token embedding is also the output projection (GShardSharedEmbeddingSoftmax), which scales the
  final hidden state by 1/sqrt(dim) before the logits, so the shared matrix can be N(0, 1).

Two deliberate differences from Pax, both for ember's shared kernels: positions are RoPE (the shared attention of
ember/nn/decoder.py) instead of GLaM's per-layer T5-style relative bias, which would need an additive
(heads, T, T) bias in every attention kernel (flash, flex, context parallel); and routing is ember's
dropless one (ember/nn/moe.py) instead of GShard's capacity-limited dispatch. No parallelism and no I/O here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.models.glam.args import GlamArgs
from ember.nn.decoder import Decoder, RMSNorm, TransformerBlock, num_params
from ember.nn.moe import MoE
from ember.nn.moe_stats import MoEOptions


class GatedFeedForward(nn.Module):
    """The dense layers' FFN: w2(gelu(w1 x) * w3 x), GELU with the tanh approximation (praxis GELU)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)  # through the GELU (praxis ffn_layer1_gate)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)  # the linear branch (praxis ffn_layer1)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh") * self.w3(x))  # (B, T, hidden) -> (B, T, dim)

    def init_weights(self, out_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w3.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w2.weight, mean=0.0, std=out_std)


def _ffn(layer_id: int, args: GlamArgs, moe: MoEOptions) -> nn.Module:
    """Layer `layer_id`'s FFN: top-k of two-matrix ReLU experts on MoE layers, the gated GELU FFN elsewhere."""
    if args.is_moe_layer(layer_id):
        return MoE(args.dim, args.ffn_hidden_dim, args.n_experts, args.top_k, activation=F.relu, gated=False,
                   options=moe)
    return GatedFeedForward(args.dim, args.ffn_hidden_dim)


class Transformer(Decoder):
    """tokens (B, T) -> logits (B, T, vocab_size); MoE and dense blocks alternate, the embedding is the output
    projection, and the final hidden state is scaled by 1/sqrt(dim) before it (GShardSharedEmbeddingSoftmax:
    logits = (h / sqrt(dim)) W^T, W the shared N(0, 1) embedding)."""

    def __init__(self, args: GlamArgs, moe: MoEOptions = MoEOptions()):
        super().__init__(args, lambda i: TransformerBlock(i, args, _ffn(i, args, moe)),
                         lambda: RMSNorm(args.dim, args.norm_eps), logit_scale=args.dim**-0.5)

    def init_embeddings(self) -> None:
        if self.tok_embeddings is not None:
            # N(0, 1), as GShard's (and T5's) shared embedding: the output's 1/sqrt(dim) keeps a random row's
            # logit near unit scale. The row of a token's own input, which the tied matrix reads back from a
            # still-shallow residual stream, starts at ~sqrt(dim) (debug: first loss ~16 vs ln V = 9.0); it
            # decays within tens of steps, and in the debug run this init still reached a lower validation
            # loss at step 40 than N(0, 0.02^2), which starts at ln V but learns slower.
            nn.init.normal_(self.tok_embeddings.weight, std=1.0)

    def init_output(self) -> None:
        nn.init.normal_(self.output.weight, std=1.0)


def flops_per_token(args: GlamArgs, seq_len: int) -> float:
    """Training FLOPs per token with *active* parameters only: 6 N_active + 12 L H Q T (PaLM, Chowdhery et al.
    2022, appendix B). N counts, per MoE layer, the top_k experts a token passes through (two matrices each)
    and the router, per dense layer the gated FFN's three matrices; the embedding lookup is left out and the
    tied matrix counted once, as the output projection. 12 L H Q T: attention scores and weighted values."""
    attn = 4 * args.dim * args.n_heads * args.head_dim  # wq, wk, wv, wo
    norms = 2 * args.dim
    dense_ffn = 3 * args.dim * args.ffn_hidden_dim
    moe_ffn = args.top_k * 2 * args.dim * args.ffn_hidden_dim + args.dim * args.n_experts  # + router
    n_moe = args.n_moe_layers
    n = (args.n_layers * (attn + norms) + n_moe * moe_ffn + (args.n_layers - n_moe) * dense_ffn
         + args.dim + args.vocab_size * args.dim)  # + final norm, output
    return 6 * n + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len


__all__ = ["Transformer", "num_params", "flops_per_token"]
