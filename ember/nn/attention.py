"""Attention kernels shared by the model families: causal, causal within documents, and local spans.

Every kernel takes q: (B, n_heads, T, head_dim), k and v: (B, n_kv_heads, T, head_dim), and optionally
document_ids: (B, T), the index of the packed document each token belongs to; with them a token
attends only to earlier tokens of its own document (block-causal), so packed documents do not see
each other. A layer with local attention also passes its `AttentionSpan` (a sliding window: Mistral,
Gemma's local layers; or fixed chunks: Llama 4's RoPE layers), which every kernel, the KV cache and
context parallelism's all-gathered form apply to true positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

# An attention kernel: (q, k, v, document_ids, span) -> out over (B, heads, T, head_dim) (GPT's takes no span).
Kernel = Callable[..., torch.Tensor]


def set_attention_kernel(model: nn.Module, kernel: Kernel) -> None:
    """The one way to choose the kernel of every attention of `model` (a model, a pipeline stage or a block):
    context parallelism's distributed forms (ember/parallel/cp.py), flex attention for document masking on CUDA
    (ember/parallel/parallelize.py) and the XLA step's pinned layout or TPU flash kernel (ember/xla/step.py).
    A model is built with `causal_attention`; the attentions' forwards call whatever this set."""
    for module in model.modules():
        if hasattr(module, "attention_fn"):  # Attention, MLA, GPT's attention
            module.attention_fn = kernel


@dataclass(frozen=True)
class AttentionSpan:
    """Which earlier keys a query sees besides causality. window: only the last `window` positions, the
    query's own included (Hugging Face's sliding_window: key k is seen from query q when q - window < k <= q).
    chunk: only keys of its own block of `chunk` positions (Llama 4's attention_chunk_size: q // chunk ==
    k // chunk). None: no limit of that kind."""

    window: Optional[int] = None
    chunk: Optional[int] = None

    def mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Positions of queries and keys (broadcastable) -> bool, True where the key is seen (causal included)."""
        return span_mask(q_pos, k_pos, self.window, self.chunk)

    def limits(self, length: int) -> bool:
        """Whether the span hides any key from some query of a sequence of `length` positions (else: plain causal)."""
        return (self.window is not None and self.window < length) or (self.chunk is not None and self.chunk < length)


def span_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: Optional[int], chunk: Optional[int]) -> torch.Tensor:
    """AttentionSpan.mask of a span given by its numbers."""
    seen = k_pos <= q_pos
    if window is not None:
        seen = seen & (q_pos - k_pos < window)
    if chunk is not None:
        seen = seen & (torch.div(q_pos, chunk, rounding_mode="floor") == torch.div(k_pos, chunk, rounding_mode="floor"))
    return seen


def scored_length(span: Optional[AttentionSpan], seq_len: int) -> float:
    """The T of PaLM's 12 L H Q T attention FLOPs for a layer with this span: twice the mean number of keys
    a query of a causal sequence sees (seq_len + 1 without a span: PaLM counts the whole T x T square, which
    is twice the causal half), so a sliding-window or chunked layer counts the work its mask leaves."""
    if span is None or not span.limits(seq_len):
        return float(seq_len)

    def seen_in(length: int) -> int:  # keys seen by the queries of one causal run of `length` positions
        w = length if span.window is None else min(span.window, length)
        return w * (w + 1) // 2 + (length - w) * w

    chunk = span.chunk or seq_len
    full, rest = divmod(seq_len, chunk)
    return 2 * (full * seen_in(chunk) + seen_in(rest)) / seq_len


def _limiting(span: Optional[AttentionSpan], length: int) -> Optional[AttentionSpan]:
    return span if span is not None and span.limits(length) else None


def document_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids -> (B, 1, T, T) bool, True where query i may attend to key j: j <= i, same document."""
    T = document_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=document_ids.device).tril()
    same = document_ids[:, :, None] == document_ids[:, None, :]  # (B, T, T)
    return (same & causal)[:, None]


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                         softcap: float) -> torch.Tensor:
    """Attention with Gemma 2's score soft-capping, scores = cap * tanh(q k^T / sqrt(head_dim) / cap) before the mask
    and softmax: written out, since SDPA has no step between the scores and the softmax. mask: bool, broadcastable
    to (B, heads, T, L), True where seen; None: causal."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # (B, heads, T, L)
    scores = softcap * torch.tanh(scores / softcap)
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - q.shape[2])
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     document_ids: Optional[torch.Tensor] = None,
                     span: Optional[AttentionSpan] = None, softcap: Optional[float] = None) -> torch.Tensor:
    """SDPA, causal; through an explicit mask when document_ids are given (block-causal) or the span limits
    what a query sees (the exact path on every device: flex attention has no CPU backward in torch 2.13);
    written out with softcap (softcapped_attention)."""
    # enable_gqa shares each K/V head with its group of query heads inside SDPA, rather than copying K/V
    # per query head (repeat_interleave): less memory traffic, and faster on CPU as on GPU.
    gqa = q.shape[1] != k.shape[1]
    span = _limiting(span, q.shape[2])
    if document_ids is None and span is None and softcap is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    mask = document_causal_mask(document_ids) if document_ids is not None else None
    if span is not None:
        positions = torch.arange(q.shape[2], device=q.device)
        local = span.mask(positions[:, None], positions[None, :])  # (T, T)
        mask = local if mask is None else mask & local
    if softcap is not None:
        return softcapped_attention(q, k, v, mask, softcap)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class KVCache:
    """Keys and values of every position generated so far, preallocated for the whole generation (B, n_kv_heads,
    max_len, head_dim), so decoding never reallocates (gpt-fast's static cache). Before each forward the caller
    calls `set_positions(slots, pad)`: slots (T,) are the cache positions of the tokens going in, pad (B,) how
    many slots at the start of each row are left padding (prompts of different lengths share one batch,
    right-aligned).
    A plain object, not a module: it is no part of the model's state."""

    def __init__(self, batch: int, kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.k = torch.zeros(batch, kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.slots = torch.zeros(0, dtype=torch.long, device=device)
        self.pad = torch.zeros(batch, dtype=torch.long, device=device)
        self.end = 0  # slots[-1] + 1, as a Python int
        self.padded = False  # whether any row has left padding
        # True: always attend over the whole preallocated length with a mask, so every decode step has the same
        # shapes (a compiled decode step then compiles once instead of once per length).
        self.static = False

    def set_positions(self, slots: torch.Tensor, pad: torch.Tensor, end: Optional[int] = None,
                      padded: Optional[bool] = None) -> None:
        """end (slots[-1] + 1) and padded (pad.any()) as Python values where the caller keeps them: each read from
        the tensors is a device sync per layer and step on a GPU."""
        self.slots, self.pad = slots, pad
        self.end = int(slots[-1]) + 1 if end is None else end
        self.padded = bool(pad.any()) if padded is None else padded

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               span: Optional[AttentionSpan] = None, softcap: Optional[float] = None) -> torch.Tensor:
        """Write this step's k, v (B, n_kv_heads, T, head_dim) at `slots`, and attend q (B, n_heads, T, head_dim)
        over every cached key at or before each query's slot, past the row's padding, within the layer's span
        (counted in each row's own positions: slot minus the row's padding)."""
        self.k.index_copy_(2, self.slots, k.to(self.k.dtype))
        self.v.index_copy_(2, self.slots, v.to(self.v.dtype))
        gqa = q.shape[1] != k.shape[1]
        # static: one set of shapes and guards for every step (the span's mask is applied whatever the length)
        span = span if self.static else _limiting(span, self.end)
        plain = not self.static and not self.padded and span is None and softcap is None
        if plain and q.shape[2] == self.end:  # a prefill from empty
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        if plain and q.shape[2] == 1:  # one token: every position so far
            k_all, v_all = self.k[:, :, :self.end].to(q.dtype), self.v[:, :, :self.end].to(q.dtype)
            return F.scaled_dot_product_attention(q, k_all, v_all, enable_gqa=gqa)
        key = torch.arange(self.k.shape[2], device=q.device)  # (L,)
        if span is None:
            causal = (key[None, :] <= self.slots[:, None])[None]  # (1, T, L)
        else:  # each row's positions: its slots less its left padding
            causal = span.mask((self.slots[None, :] - self.pad[:, None])[:, :, None],
                               (key[None, :] - self.pad[:, None])[:, None, :])  # (B, T, L)
        real = key[None, :] >= self.pad[:, None]  # (B, L): not left padding
        # A padding query may see itself, so its (discarded) row stays finite rather than NaN.
        mask = (causal & real[:, None, :]) | (key[None, :] == self.slots[:, None])[None]  # (B, T, L)
        if softcap is not None:
            return softcapped_attention(q, self.k.to(q.dtype), self.v.to(q.dtype), mask[:, None], softcap)
        return F.scaled_dot_product_attention(q, self.k.to(q.dtype), self.v.to(q.dtype), attn_mask=mask[:, None],
                                              enable_gqa=gqa)


class FlexAttention:
    """Block-causal and local-span attention with flex attention's sparse BlockMask (CUDA): fully masked
    blocks (other documents, keys past a sliding window or outside a chunk) are skipped instead of computed
    and discarded. `prepare` builds one mask per span of the model's layers for a batch, eagerly, before the
    blocks run (parallelize makes it the model's forward pre-hook): compiled blocks then only read the masks,
    where a cache consulted inside them (keyed by the document_ids tensor) made each new batch a guard failure
    and a recompilation."""

    def __init__(self, spans: Iterable[Optional[AttentionSpan]]) -> None:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        self._create_block_mask = create_block_mask
        self._flex = torch.compile(flex_attention)  # flex attention is only fast compiled
        self._spans = set(spans)
        self._masks: dict[tuple[Optional[int], Optional[int]], object] = {}  # (window, chunk) -> BlockMask

    def prepare(self, document_ids: Optional[torch.Tensor], length: int, device: torch.device) -> None:
        """The masks of a batch of `length` positions (document_ids (B, T), or None: plain causal documents)."""
        self._masks = {}
        for span in self._spans:
            span = _limiting(span, length)
            if span is None and document_ids is None:
                continue  # plain causal: SDPA's own
            batch = document_ids.shape[0] if document_ids is not None else None
            self._masks[_span_key(span)] = self._create_block_mask(_mask_mod(document_ids, *_span_key(span)), batch,
                                                                   None, length, length, device=device)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 document_ids: Optional[torch.Tensor] = None, span: Optional[AttentionSpan] = None) -> torch.Tensor:
        span = _limiting(span, q.shape[2])
        if document_ids is None and span is None:
            return causal_attention(q, k, v)
        block_mask = self._masks[_span_key(span)]
        return self._flex(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])


def _span_key(span: Optional[AttentionSpan]) -> tuple[Optional[int], Optional[int]]:
    return (span.window, span.chunk) if span is not None else (None, None)


def _mask_mod(document_ids: Optional[torch.Tensor], window: Optional[int],
              chunk: Optional[int]) -> Callable[..., torch.Tensor]:
    """flex attention's mask_mod: whether query q_idx of row b sees key kv_idx (causal, span, same document). It
    holds the span's numbers, not a layer's AttentionSpan: compiled blocks would guard on which object it was."""
    def visible(b, h, q_idx, kv_idx):
        seen = span_mask(q_idx, kv_idx, window, chunk)
        return seen & (document_ids[b, q_idx] == document_ids[b, kv_idx]) if document_ids is not None else seen

    return visible


def document_layout(tokens: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed tokens (B, T) -> (document_ids, positions), each (B, T). A document ends with its EOS, so
    the token after an EOS starts the next document; positions count from 0 within each document."""
    is_eos = (tokens == eos_id).long()
    document_ids = torch.cumsum(is_eos, dim=1) - is_eos  # EOS tokens before this one
    index = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    starts_doc = torch.ones_like(is_eos, dtype=torch.bool)
    starts_doc[:, 1:] = is_eos[:, :-1].bool()
    start = torch.cummax(torch.where(starts_doc, index, torch.zeros_like(index)), dim=1).values
    return document_ids, index - start
