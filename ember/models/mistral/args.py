"""Mistral hyper-parameters and the published sizes (FLAVORS)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from ember.models.checks import no_llama3_scaling
from ember.nn.args import GroupedQueryArgs
from ember.nn.attention import AttentionSpan
from ember.nn.rope import RopeConfig


@dataclass(frozen=True, kw_only=True)
class MistralArgs(GroupedQueryArgs):
    ffn_hidden_dim: int  # the SwiGLU hidden size (Mistral states it outright)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 32768
    tie_embeddings: bool = False
    # Each query sees the last sliding_window positions, itself included (Mistral 7B v0.1: 4096); None: all.
    sliding_window: Optional[int] = None
    rope_scaling_factor: Optional[float] = None  # kept for model.json's key: Mistral's RoPE has no scaling

    @property
    def rope(self) -> RopeConfig:
        return RopeConfig(self.rope_theta, self.head_dim, self.max_seq_len)

    def layer_span(self, layer_id: int) -> Optional[AttentionSpan]:
        return AttentionSpan(window=self.sliding_window) if self.sliding_window is not None else None

    def validate(self) -> None:
        super().validate()
        no_llama3_scaling(self.rope_scaling_factor)


# From the config.json of each release on the Hugging Face hub (mistralai/*).
_V01 = MistralArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000, ffn_hidden_dim=14336,
                   sliding_window=4096)
FLAVORS: dict[str, MistralArgs] = {
    # A laptop-sized Mistral whose window (64) is shorter than the default run's 256-token sequences.
    "debug": replace(_V01, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=8192, ffn_hidden_dim=704,
                     max_seq_len=2048, sliding_window=64),
    "7B": _V01,  # Mistral-7B-v0.1
    "7B-v0.3": replace(_V01, vocab_size=32768, rope_theta=1_000_000.0, sliding_window=None),
    "Nemo-12B": replace(_V01, dim=5120, n_layers=40, vocab_size=131072, head_dim_override=128,
                        rope_theta=1_000_000.0, max_seq_len=1_024_000, sliding_window=None),
}
