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

Two deliberate differences from Pax, both for ember's shared kernels: positions are RoPE (Llama's attention,
shared like Mixtral does) instead of GLaM's per-layer T5-style relative bias, which would need an additive
(heads, T, T) bias in every attention kernel (flash, flex, context parallel); and routing is ember's
dropless one (ember/nn/moe.py) instead of GShard's capacity-limited dispatch. No parallelism and no I/O here.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ember.models.glam.args import GlamArgs
from ember.models.llama.model import Attention, RMSNorm, rope_cos_sin
from ember.nn.moe import MoE, _local


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


class Experts(nn.Module):
    """E two-matrix experts, w2[e](relu(w1[e] x)), as 3-D weights: w1 (E, hidden, dim), w2 (E, dim, hidden).
    The interface of ember/nn/moe.py's SwiGLU Experts, so MoE (and expert parallelism, which shards every
    parameter over dim 0) runs them unchanged, and the same two paths under the same rules: grouped
    (`F.grouped_mm`, where MoE's `grouped` says so and the hidden rows are 16-byte multiples) or looped;
    `impl` = "grouped" | "looped" forces one."""

    def __init__(self, n_experts: int, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.impl: Optional[str] = None  # None: the caller's choice; "grouped" | "looped": forced

    def forward(self, x_sorted: torch.Tensor, counts: torch.Tensor, grouped: bool) -> torch.Tensor:
        """x_sorted (M, dim), grouped by expert in order, counts (E,) tokens per expert -> (M, dim)."""
        w1, w2 = _local(self.w1), _local(self.w2)  # this rank's experts under expert parallelism
        device = x_sorted.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x_sorted.dtype
        if self.impl is not None:
            if self.impl not in ("grouped", "looped"):
                raise ValueError(f"Experts.impl must be None, 'grouped' or 'looped', not {self.impl!r}")
            grouped = self.impl == "grouped"
        elif w1.shape[1] * dtype.itemsize % 16:  # grouped_mm wants rows of 16-byte multiples
            grouped = False
        if grouped:
            # grouped_mm is on no autocast list: cast to the dtype autocast gives the looped matmuls.
            x_sorted, w1, w2 = (t.to(dtype) for t in (x_sorted, w1, w2))
            offsets = torch.cumsum(counts, 0).to(torch.int32)
            h = F.relu(F.grouped_mm(x_sorted, w1.transpose(-2, -1), offs=offsets))  # (M, hidden)
            return F.grouped_mm(h, w2.transpose(-2, -1), offs=offsets)  # (M, dim)
        # unbind, not w[e]: each w[e]'s backward writes a zero-filled (E, ...) gradient (see moe.py).
        outputs = []
        for block, w1_e, w2_e in zip(torch.split(x_sorted, counts.tolist()), w1.unbind(0), w2.unbind(0)):
            if block.shape[0] == 0:
                continue
            outputs.append(F.relu(block @ w1_e.t()) @ w2_e.t())  # (n_e, hidden) -> (n_e, dim)
        return torch.cat(outputs) if outputs else x_sorted.new_zeros(x_sorted.shape)

    def init_weights(self, out_std: float) -> None:
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w2, mean=0.0, std=out_std)


class TransformerBlock(nn.Module):
    """Attention, then either the MoE (`moe`) or the dense FFN (`feed_forward`); the other is None."""

    def __init__(self, layer_id: int, args: GlamArgs):
        super().__init__()
        self.attention = Attention(args)  # type: ignore[arg-type]  # duck-typed args: same fields
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.moe: Optional[MoE] = None
        self.feed_forward: Optional[GatedFeedForward] = None
        if args.is_moe_layer(layer_id):
            experts = Experts(args.n_experts, args.dim, args.ffn_hidden_dim)
            self.moe = MoE(args.dim, args.ffn_hidden_dim, args.n_experts, args.top_k, experts=experts)
        else:
            self.feed_forward = GatedFeedForward(args.dim, args.ffn_hidden_dim)
        # Depth-scaled init of what writes into the residual stream (torchtitan's depth_init).
        self.out_std = 0.02 / math.sqrt(2 * (layer_id + 1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, document_ids)  # (B, T, dim)
        ffn = self.moe if self.moe is not None else self.feed_forward
        return h + ffn(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()
        self.attention.init_weights(self.out_std)
        (self.moe if self.moe is not None else self.feed_forward).init_weights(self.out_std)


class Transformer(nn.Module):
    """tokens (B, T) -> logits (B, T, vocab_size); pipeline stages may drop embedding, norm or output."""

    def __init__(self, args: GlamArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings: Optional[nn.Embedding] = nn.Embedding(args.vocab_size, args.dim)
        # Keyed by layer index: names stay stable when a pipeline stage keeps only some of the layers.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm: Optional[RMSNorm] = RMSNorm(args.dim, args.norm_eps)
        self.output: Optional[nn.Linear] = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        self.output_chunks = 1  # > 1: logits as a list of sequence chunks (see the Llama model)
        cos, sin = rope_cos_sin(args)  # type: ignore[arg-type]
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, positions: Optional[torch.Tensor] = None,
                document_ids: Optional[torch.Tensor] = None) -> torch.Tensor | list[torch.Tensor]:
        """positions: (T,) or (B, T), default 0..T-1; document_ids: (B, T) for block-causal attention
        within packed documents (see the Llama model)."""
        T = tokens.shape[1]
        if positions is None:
            if T > self.rope_cos.shape[0]:
                raise ValueError(f"sequence length {T} exceeds max_seq_len={self.rope_cos.shape[0]}")
            cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # (T, head_dim // 2)
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens  # (B, T, dim)
        for layer in self.layers.values():
            h = layer(h, cos, sin, document_ids)
        h = self.norm(h) if self.norm is not None else h
        if self.output is None:
            return h
        # GShardSharedEmbeddingSoftmax: logits = (h / sqrt(dim)) W^T, W the shared N(0, 1) embedding.
        h = h * self.args.dim**-0.5
        if self.output_chunks > 1:
            return [self.output(chunk) for chunk in h.tensor_split(self.output_chunks, dim=1)]
        return self.output(h)  # (B, T, vocab_size)

    def moe_layers(self) -> list[MoE]:
        """The MoE modules of this model (or pipeline stage), in layer order: every moe_every-th layer."""
        return [layer.moe for layer in self.layers.values() if layer.moe is not None]

    def tie_weights(self) -> None:
        """With tie_embeddings, make output.weight the embedding Parameter itself. `to_empty()` and
        `load_state_dict(assign=True)` give each module a Parameter of its own, so call it after them."""
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_rope(self, device: Optional[torch.device] = None) -> None:
        """Recompute the RoPE tables in fp32 on `device` (default: where they are now)."""
        cos, sin = rope_cos_sin(self.args, device=device or self.rope_cos.device)  # type: ignore[arg-type]
        self.rope_cos, self.rope_sin = cos, sin

    @torch.no_grad()
    def init_weights(self, buffer_device: Optional[torch.device] = None) -> None:
        """Fill every parameter and buffer: after `to_empty`, a model built on meta gets real values."""
        self.init_rope(buffer_device)
        self.tie_weights()  # undone by to_empty
        if self.tok_embeddings is not None:
            # N(0, 1), as GShard's (and T5's) shared embedding: the output's 1/sqrt(dim) keeps a random row's
            # logit near unit scale. The row of a token's own input, which the tied matrix reads back from a
            # still-shallow residual stream, starts at ~sqrt(dim) (debug: first loss ~16 vs ln V = 9.0); it
            # decays within tens of steps, and in the debug run this init still reached a lower loss at
            # step 40 than N(0, 0.02^2) (7.46 vs 8.07 validation), which starts at ln V but learns slower.
            nn.init.normal_(self.tok_embeddings.weight, std=1.0)
        for layer in self.layers.values():
            layer.init_weights()
        if self.norm is not None:
            self.norm.init_weights()
        if self.output is not None and not self.args.tie_embeddings:
            nn.init.normal_(self.output.weight, std=1.0)


def num_params(model: nn.Module, active: bool = False) -> int:
    """Parameters, a tied matrix counted once; active=True counts only top_k of each MoE layer's experts
    (what one token passes through). Works on a pipeline stage: it counts the MoE layers it holds."""
    total = sum(p.numel() for p in model.parameters())
    if not active:
        return total
    idle = 0
    for moe in model.moe_layers():
        per_expert = sum(p.numel() for p in moe.experts.parameters()) // moe.n_experts
        idle += (moe.n_experts - moe.top_k) * per_expert
    return total - idle


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
