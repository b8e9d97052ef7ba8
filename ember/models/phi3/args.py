"""Phi-3 hyper-parameters and the published sizes (FLAVORS)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar, Optional

from ember.nn.attention import AttentionSpan
from ember.nn.decoder import HeadShape


@dataclass(frozen=True, kw_only=True)
class Phi3Args(HeadShape):
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: Optional[int] = None
    vocab_size: int
    ffn_hidden_dim: int  # the SwiGLU hidden size (config.json's intermediate_size)
    head_dim_override: Optional[int] = None  # each head's width where not dim / n_heads: `model.head_dim`
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    # Each query sees the last sliding_window positions, itself included (the 4K models: 2047); None: all.
    sliding_window: Optional[int] = None
    rope_scaling_factor: Optional[float] = None  # read by the shared RoPE code: Phi-3 has no Llama 3.1 scaling
    # A partial rotary embedding: RoPE turns the first partial_rotary_factor of each head (Phi-4-mini: 0.75)
    partial_rotary_factor: float = 1.0
    # LongRoPE (the 128K models): one factor per frequency, short ones while a sequence stays within
    # rope_original_max_seq_len, long ones past it; q and k scaled by rope_attention_factor (default
    # sqrt(1 + ln(max_seq_len / original) / ln(original))). None: plain RoPE.
    rope_short_factor: Optional[tuple[float, ...]] = None
    rope_long_factor: Optional[tuple[float, ...]] = None
    rope_original_max_seq_len: int = 4096
    rope_attention_factor: Optional[float] = None

    CONFIG_KEYS: ClassVar[dict[str, str]] = {"head_dim": "head_dim_override"}

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rope_ext_factors(self) -> Optional[tuple[float, ...]]:
        return self.rope_short_factor  # the default tables; long_rope_args gives the others

    @property
    def rope_table_scale(self) -> Optional[float]:
        if self.rope_short_factor is None:
            return None
        if self.rope_attention_factor is not None:
            return self.rope_attention_factor
        factor = self.max_seq_len / self.rope_original_max_seq_len
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(self.rope_original_max_seq_len))

    def layer_span(self, layer_id: int) -> Optional[AttentionSpan]:
        return AttentionSpan(window=self.sliding_window) if self.sliding_window is not None else None


# From the config.json of each release on the Hugging Face hub (microsoft/Phi-3-*-4k-instruct).
_MINI = Phi3Args(dim=3072, n_layers=32, n_heads=32, vocab_size=32064, ffn_hidden_dim=8192, sliding_window=2047)
FLAVORS: dict[str, Phi3Args] = {
    "debug": replace(_MINI, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=8192, ffn_hidden_dim=704,
                     max_seq_len=2048, sliding_window=64),
    "mini-4k": _MINI,  # Phi-3-mini-4k: 3.8B
    "medium-4k": replace(_MINI, dim=5120, n_layers=40, n_heads=40, n_kv_heads=10, ffn_hidden_dim=17920),  # 14B
}
