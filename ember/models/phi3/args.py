"""Phi-3 hyper-parameters and the published sizes (FLAVORS)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

from ember.models.checks import no_llama3_scaling
from ember.nn.args import GroupedQueryArgs
from ember.nn.attention import AttentionSpan
from ember.nn.rope import LongRopeScaling, RopeConfig


@dataclass(frozen=True, kw_only=True)
class Phi3Args(GroupedQueryArgs):
    ffn_hidden_dim: int  # the SwiGLU hidden size (config.json's intermediate_size)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    # Each query sees the last sliding_window positions, itself included (the 4K models: 2047); None: all.
    sliding_window: Optional[int] = None
    rope_scaling_factor: Optional[float] = None  # kept for model.json's key: Phi-3 has no Llama 3.1 scaling
    # A partial rotary embedding: RoPE turns the first partial_rotary_factor of each head (Phi-4-mini: 0.75)
    partial_rotary_factor: float = 1.0
    # LongRoPE (the 128K models): one factor per frequency, short ones while a sequence stays within
    # rope_original_max_seq_len, long ones past it; q and k scaled by rope_attention_factor (default
    # sqrt(1 + ln(max_seq_len / original) / ln(original))). None: plain RoPE.
    rope_short_factor: Optional[tuple[float, ...]] = None
    rope_long_factor: Optional[tuple[float, ...]] = None
    rope_original_max_seq_len: int = 4096
    rope_attention_factor: Optional[float] = None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rope(self) -> RopeConfig:
        """The default tables: the short factors' (long_rope gives the others)."""
        return self._rope_with(self.rope_short_factor)

    @property
    def long_rope(self) -> Optional[RopeConfig]:
        """LongRoPE's tables for a forward whose positions reach past rope_original_max_seq_len; None: none."""
        return self._rope_with(self.rope_long_factor) if self.rope_long_factor is not None else None

    def _rope_with(self, factors: Optional[tuple[float, ...]]) -> RopeConfig:
        # both tables carry LongRoPE's attention factor, which the short factors' presence turns on
        scaling = None if factors is None else LongRopeScaling(factors, self._long_rope_attention_factor())
        return RopeConfig(self.rope_theta, self.rotary_dim or self.head_dim, self.max_seq_len, scaling)

    def _long_rope_attention_factor(self) -> Optional[float]:
        if self.rope_short_factor is None:
            return None
        if self.rope_attention_factor is not None:
            return self.rope_attention_factor
        factor = self.max_seq_len / self.rope_original_max_seq_len
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(self.rope_original_max_seq_len))

    def layer_span(self, layer_id: int) -> Optional[AttentionSpan]:
        return AttentionSpan(window=self.sliding_window) if self.sliding_window is not None else None

    def validate(self) -> None:
        super().validate()
        no_llama3_scaling(self.rope_scaling_factor)


# From the config.json of each release on the Hugging Face hub (microsoft/Phi-3-*-4k-instruct).
_MINI = Phi3Args(dim=3072, n_layers=32, n_heads=32, vocab_size=32064, ffn_hidden_dim=8192, sliding_window=2047)
FLAVORS: dict[str, Phi3Args] = {
    "debug": replace(_MINI, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=8192, ffn_hidden_dim=704,
                     max_seq_len=2048, sliding_window=64),
    "mini-4k": _MINI,  # Phi-3-mini-4k: 3.8B
    "medium-4k": replace(_MINI, dim=5120, n_layers=40, n_heads=40, n_kv_heads=10, ffn_hidden_dim=17920),  # 14B
}
