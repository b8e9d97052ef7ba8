"""The decoder skeleton every family shares, and the RoPE attention most of them use.

`Decoder`: tokens -> embedding -> blocks (a ModuleDict keyed by layer index) -> final norm -> output
projection, with RoPE tables, tied embeddings, chunked logits and `init_weights` for models built on the
meta device. A family subclasses it and supplies only its block (and so its FFN or experts), its norm,
and, where they differ, how its embeddings and output start (`init_embeddings`, `init_output`).

Pipeline stages set tok_embeddings, norm or output to None; each then passes its input through, so a
middle stage maps hidden states (B, T, dim) to hidden states. See docs/architecture.md.

The hyper-parameters are a DecoderArgs (nn/args.py), which every family's args extend; the RoPE tables come from
its typed RopeConfig (nn/rope.py: Meta's convention, consecutive pairs of each head rotate together).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import nn

from ember.nn.args import DecoderArgs
from ember.nn.attention import AttentionSpan, KVCache, causal_attention
from ember.nn.moe import MoE
from ember.nn.rope import apply_rope, rope_cos_sin

# Decoder.forward's output_fn: (final hidden states (B, T, dim), output matrix (vocab_size, dim), soft cap) -> result
OutputFn = Callable[[torch.Tensor, torch.Tensor, Optional[float]], torch.Tensor]


def has_local_attention(args: DecoderArgs) -> bool:
    """Whether any layer attends within a local span (a sliding window, chunks): a family's args say which by
    `layer_span(layer_id)` (None: the whole causal context)."""
    return any(args.layer_span(i) is not None for i in range(args.n_layers))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32 even for bf16 activations, cast back before the gain (Meta's reference).
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight

    def reset_parameters(self) -> None:  # nn.LayerNorm's name, so the decoder resets either alike
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    """Grouped-query attention with RoPE (Llama, Mixtral, GLaM, Qwen, Mistral): (B, T, dim) -> (B, T, dim).

    Where a family needs them: qkv_bias, biases on the q/k/v projections (Qwen2); qk_norm, a norm over each
    head's width applied to q and k before RoPE (Qwen3's RMSNorm); span, local attention (a sliding window or
    chunks) that every attention kernel applies; score_scale, the scores' scale where it is not head_dim ** -0.5
    (Gemma's query_pre_attn_scalar ** -0.5), applied to q after RoPE so every kernel keeps its default; softcap,
    Gemma 2's cap * tanh(score / cap) on the scores; rope=False, no rotary embedding (Llama 4's NoPE layers): the
    decoder then passes (q_scale, None) in place of (cos, sin), q_scale (T, 1) or (B, T, 1) a per-position factor on
    q (Llama 4's attention temperature) or None."""

    def __init__(self, args: DecoderArgs, *, qkv_bias: bool = False,
                 qk_norm: Optional[Callable[[int], nn.Module]] = None, span: Optional[AttentionSpan] = None,
                 score_scale: Optional[float] = None, softcap: Optional[float] = None, rope: bool = True):
        super().__init__()
        self.rope = rope
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=qkv_bias)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)
        self.q_norm: Optional[nn.Module] = qk_norm(self.head_dim) if qk_norm is not None else None
        self.k_norm: Optional[nn.Module] = qk_norm(self.head_dim) if qk_norm is not None else None
        self.span = span
        self.q_factor = score_scale * math.sqrt(self.head_dim) if score_scale is not None else None
        self.softcap = softcap  # Gemma 2's score soft-capping: the written-out kernel, whatever attention_fn is
        # The attention kernel, (q, k, v, document_ids, span) -> out over (B, heads, T, head_dim); chosen by
        # nn/attention.set_attention_kernel (context parallelism, flex attention, the XLA step), the one way.
        self.attention_fn: Callable[..., torch.Tensor] = causal_attention
        self.kv_cache: Optional[KVCache] = None  # incremental decoding's (ember.generate, through use_kv_cache)

    def use_kv_cache(self, cache: Optional[KVCache]) -> None:
        """Decode incrementally into `cache` (None: back to whole-sequence attention)."""
        self.kv_cache = cache

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads, not n_heads: under tensor parallelism each rank holds n_heads / tp of them.
        q = self.wq(x).view(B, T, -1, self.head_dim)  # (B, T, n_heads, head_dim)
        k = self.wk(x).view(B, T, -1, self.head_dim)  # (B, T, n_kv_heads, head_dim)
        v = self.wv(x).view(B, T, -1, self.head_dim)  # (B, T, n_kv_heads, head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        elif cos is not None:  # NoPE: cos is the per-position q scale
            q = (q * cos[..., None]).to(q.dtype)  # (T, 1, 1) or (B, T, 1, 1) over (B, T, heads, head_dim)
        if self.q_factor is not None:
            q = q * self.q_factor
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, head_dim), the layout SDPA takes
        if self.kv_cache is not None:
            out = self.kv_cache.attend(q, k, v, self.span, self.softcap)  # (B, n_heads, T, head_dim), cached positions
        elif self.softcap is not None:
            out = causal_attention(q, k, v, document_ids, self.span, self.softcap)
        else:
            out = self.attention_fn(q, k, v, document_ids, self.span)  # (B, n_heads, T, head_dim)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))  # (B, T, n_heads * head_dim) -> (B, T, dim)

    def init_weights(self, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=out_std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()


def depth_scaled_std(layer_id: int) -> float:
    """Init std of what writes into the residual stream at layer `layer_id` (torchtitan's depth_init)."""
    return 0.02 / math.sqrt(2 * (layer_id + 1))


class TransformerBlock(nn.Module):
    """Pre-norm block with RoPE attention: h = x + attention(norm(x)); out = h + ffn(norm(h)). The FFN is
    the family's: a dense `feed_forward`, or a `moe` layer (the other attribute is then None), so each
    family's parameter names, and its tensor-parallel plan entries, say which it is."""

    def __init__(self, layer_id: int, args: DecoderArgs, ffn: nn.Module, attention: Optional[nn.Module] = None):
        super().__init__()
        self.attention = attention if attention is not None else Attention(args)
        self.feed_forward: Optional[nn.Module] = None if isinstance(ffn, MoE) else ffn
        self.moe: Optional[MoE] = ffn if isinstance(ffn, MoE) else None
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.out_std = depth_scaled_std(layer_id)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, document_ids)  # (B, T, dim)
        ffn = self.moe if self.moe is not None else self.feed_forward
        return h + ffn(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.out_std)
        (self.moe if self.moe is not None else self.feed_forward).init_weights(self.out_std)


class Decoder(nn.Module):
    """tokens (B, T) -> logits (B, T, vocab_size); see the module docstring.

    Positions are either RoPE (args.rope, its tables: blocks are called as block(h, cos, sin, document_ids)) or a
    learned table added to the token embeddings (args.rope None, GPT: `pos_embeddings`, blocks are called as
    block(h, document_ids)). `logit_scale` multiplies the final hidden state before the output projection
    (GLaM's shared-embedding softmax); `logit_softcap` caps the logits at cap * tanh(logit / cap) (Gemma 2)."""

    def __init__(self, args: DecoderArgs, make_block: Callable[[int], nn.Module], make_norm: Callable[[], nn.Module],
                 *, logit_scale: Optional[float] = None, logit_softcap: Optional[float] = None):
        super().__init__()
        self.args = args
        rope, local_rope = args.rope, args.local_rope
        self.rope, self.logit_scale, self.logit_softcap = rope is not None, logit_scale, logit_softcap
        self.tok_embeddings: Optional[nn.Embedding] = nn.Embedding(args.vocab_size, args.dim)
        # The learned position table goes with the token embedding: a pipeline's first stage holds both.
        self.pos_embeddings: Optional[nn.Embedding] = None if self.rope else nn.Embedding(args.max_seq_len, args.dim)
        # Keyed by layer index: names stay stable when a pipeline stage keeps only some of the layers.
        self.layers = nn.ModuleDict({str(i): make_block(i) for i in range(args.n_layers)})
        self.norm: Optional[nn.Module] = make_norm()
        self.output: Optional[nn.Linear] = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        if rope is not None:  # not persistent: derived from args, recomputed by init_rope, never in checkpoints
            cos, sin = rope_cos_sin(rope)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        if rope is not None and local_rope is not None:  # a block with `rope_table = "_local"` rotates by these
            cos, sin = rope_cos_sin(local_rope)
            self.register_buffer("rope_local_cos", cos, persistent=False)
            self.register_buffer("rope_local_sin", sin, persistent=False)

    def embed(self, tokens: torch.Tensor, positions: Optional[torch.Tensor]) -> torch.Tensor:
        """tokens (B, T) -> hidden states (B, T, dim), plus the learned positions (default 0..T-1) where the
        model has them; a later pipeline stage gets hidden states already and passes them through."""
        if self.tok_embeddings is None:
            return tokens
        if self.pos_embeddings is None:
            return self.tok_embeddings(tokens)
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        # (1 or B, T): a 2-D index makes the lookup (1 or B, T, dim), whose dim 1 is the sequence, the dim
        # that tensor parallelism's sequence-sharded layout splits, as for the token lookup.
        positions = positions if positions.dim() == 2 else positions[None]
        return self.tok_embeddings(tokens) + self.pos_embeddings(positions)  # (B, T, dim)

    def forward(self, tokens: torch.Tensor, positions: Optional[torch.Tensor] = None,
                document_ids: Optional[torch.Tensor] = None,
                logits_at: Optional[torch.Tensor] = None, *, last_only: bool = False,
                chunks: int = 1, output_fn: Optional[OutputFn] = None) -> torch.Tensor | list[torch.Tensor]:
        """positions: (T,) or (B, T), the position of each token, default 0..T-1 (context parallelism
        passes its slice's; document masking restarts them per document). document_ids: (B, T), the
        packed document of each token, so attention stays within documents; default: plain causal.
        logits_at: (B, K), the only positions whose logits are wanted: (B, K, vocab_size) comes back, and the
        output projection of every other position is skipped (scoring needs a few positions per row; at a
        small model's size the projection is a third of the forward's FLOPs). Plain (unsharded) hidden
        states only. last_only: the last position's logits only, (B, 1, vocab_size): what generation samples from.
        chunks > 1: the logits as a list of `chunks` (B, T_i, vocab_size) pieces along T, so the loss can consume
        each before the next exists in full (torchtune's chunked output).
        output_fn: output_fn(h, output.weight, logit_softcap)'s result in place of the logits: the step's loss
        fused with the projection (ember.nn.loss.linear_cross_entropy_sum), so no whole logits exist.
        A pipeline stage without the output projection returns its hidden states (B, T, dim)."""
        T = tokens.shape[1]
        if positions is None and T > self.args.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len={self.args.max_seq_len}")
        # Each layer's `rope_table` names the position tables it takes: "" (default), "_local" (Gemma 3's local
        # layers), or a family's own (`_rope_at` picks their rows once per forward).
        tables: dict[str, tuple[Optional[torch.Tensor], ...]] = {}
        h = self.embed(tokens, positions)  # (B, T, dim)
        for layer in self.layers.values():
            which = getattr(layer, "rope_table", "")
            if which not in tables:
                tables[which] = self._rope_at(positions, T, which)
            h = layer(h, *tables[which], document_ids)
        h = self.norm(h) if self.norm is not None else h
        if self.output is None:
            return h
        if last_only:
            h = h[:, -1:]  # (B, 1, dim)
        elif logits_at is not None:
            h = h.gather(1, logits_at[..., None].expand(-1, -1, h.shape[-1]))  # (B, K, dim)
        if self.logit_scale is not None:
            h = h * self.logit_scale
        if output_fn is not None:
            return output_fn(h, self.output.weight, self.logit_softcap)
        if chunks > 1:
            return [self._logits(chunk) for chunk in h.tensor_split(chunks, dim=1)]
        return self._logits(h)  # (B, T, vocab_size)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.output(h)
        if self.logit_softcap is None:
            return logits
        return self.logit_softcap * torch.tanh(logits / self.logit_softcap)

    def _rope_at(self, positions: Optional[torch.Tensor], T: int, which: str) -> tuple[torch.Tensor, ...]:
        """The (cos, sin) rows of `positions` (default 0..T-1) from the tables rope{which}_cos/sin; () without them."""
        if not self.rope or not hasattr(self, f"rope{which}_cos"):
            return ()
        cos, sin = getattr(self, f"rope{which}_cos"), getattr(self, f"rope{which}_sin")
        if positions is None:
            return cos[:T], sin[:T]  # (T, head_dim // 2) each
        return cos[positions], sin[positions]  # (T or B x T, head_dim // 2)

    def moe_layers(self) -> list[MoE]:
        """The MoE layers of this model (or pipeline stage), in layer order; empty for a dense family."""
        return [m for m in self.layers.modules() if isinstance(m, MoE)]

    def tie_weights(self) -> None:
        """With tie_embeddings, make output.weight the embedding Parameter itself. `to_empty()` and
        `load_state_dict(assign=True)` give each module a Parameter of its own, so call it after them."""
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_rope(self, device: Optional[torch.device] = None) -> None:
        """Recompute the RoPE tables in fp32 on `device` (default: where they are now)."""
        rope, local_rope = self.args.rope, self.args.local_rope
        if rope is not None:
            device = device or self.rope_cos.device
            self.rope_cos, self.rope_sin = rope_cos_sin(rope, device=device)
        if rope is not None and local_rope is not None:
            self.rope_local_cos, self.rope_local_sin = rope_cos_sin(local_rope, device=device)

    @torch.no_grad()
    def init_weights(self, buffer_device: Optional[torch.device] = None) -> None:
        """Fill every parameter and buffer: after `to_empty`, a model built on meta gets real values."""
        self.init_rope(buffer_device)
        self.tie_weights()  # undone by to_empty
        for _, fill in self.init_steps():
            fill()

    def init_steps(self) -> list[tuple[list[nn.Module], Callable[[], None]]]:
        """init_weights's fills in the order it runs them, each with the modules whose parameters it fills. Run in
        this order after one torch.manual_seed they draw the same random numbers whether the model is real
        whole or one piece at a time (the XLA path initialises a model too large for a host that way)."""
        embeddings = [table for table in (self.tok_embeddings, self.pos_embeddings) if table is not None]
        steps: list[tuple[list[nn.Module], Callable[[], None]]] = (
            [(embeddings, self.init_embeddings)] if embeddings else [])
        steps += [([layer], layer.init_weights) for layer in self.layers.values()]
        if self.norm is not None:
            steps.append(([self.norm], self.norm.reset_parameters))
        if self.output is not None and not self.args.tie_embeddings:
            steps.append(([self.output], self.init_output))
        return steps

    def init_embeddings(self) -> None:
        if self.tok_embeddings is not None:
            # torchtitan's N(0, 1), except when the matrix is also the output projection: there 1.0
            # would make logits of size sqrt(dim), so it gets GPT-2's 0.02.
            nn.init.normal_(self.tok_embeddings.weight, std=0.02 if self.args.tie_embeddings else 1.0)

    def init_output(self) -> None:
        std = self.args.dim**-0.5  # torchtitan: logits start near unit scale, cut off at 3 std
        nn.init.trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std)


def num_params(model: nn.Module, *, exclude_embedding: bool = False, active: bool = False) -> int:
    """Parameters of a model (or pipeline stage), a tied matrix counted once. exclude_embedding: without
    the lookup tables (tok_embeddings, and so a tied output, which is the same matrix; GPT's learned
    positions). active: only top_k of each MoE layer's experts (what one token passes through)."""
    n = sum(p.numel() for p in model.parameters())
    if exclude_embedding:
        for table in (getattr(model, "tok_embeddings", None), getattr(model, "pos_embeddings", None)):
            n -= table.weight.numel() if table is not None else 0
    if active:
        for moe in model.modules():
            if isinstance(moe, MoE):
                per_expert = sum(p.numel() for p in moe.experts.parameters()) // moe.n_experts
                n -= (moe.n_experts - moe.top_k) * per_expert
    return n
