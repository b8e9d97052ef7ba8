"""Gemma 3 (text) and Gemma 2 hyper-parameters and the published sizes (FLAVORS), by family."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from ember.models.checks import no_llama3_scaling
from ember.nn.args import GroupedQueryArgs
from ember.nn.attention import AttentionSpan
from ember.nn.rope import LinearScaling, RopeConfig


@dataclass(frozen=True, kw_only=True)
class GemmaArgs(GroupedQueryArgs):
    ffn_hidden_dim: int  # the GeGLU's hidden size (config.json's intermediate_size)
    # head_dim_override: each head's width, 256 (1B-12B), 128 (27B)
    norm_eps: float = 1e-6
    # Attention scores are scaled by query_pre_attn_scalar ** -0.5 (not head_dim ** -0.5: the 27B's 168)
    query_pre_attn_scalar: int = 256
    # Local layers attend to the last sliding_window positions; every global_every-th layer (5 local : 1 global)
    # attends to the whole causal context.
    sliding_window: int = 1024
    global_every: int = 6
    rope_theta: float = 1_000_000.0  # the global layers' base
    rope_linear_factor: Optional[float] = None  # the global layers' position interpolation (4B-27B: 8)
    local_rope_theta: Optional[float] = 10_000.0  # the local layers' base, unscaled (None: the global layers' tables)
    qk_norm: bool = True  # (1 + w) RMSNorm over each head on q and k (Gemma 3; Gemma 2 has none)
    # Gemma 2's soft-capping, cap * tanh(x / cap): of the attention scores, and of the output logits
    attn_softcap: Optional[float] = None
    final_softcap: Optional[float] = None
    max_seq_len: int = 131072
    tie_embeddings: bool = True
    rope_scaling_factor: Optional[float] = None  # kept for model.json's key: Gemma has no Llama 3.1 scaling

    @property
    def rope(self) -> RopeConfig:
        scaling = LinearScaling(self.rope_linear_factor) if self.rope_linear_factor is not None else None
        return RopeConfig(self.rope_theta, self.head_dim, self.max_seq_len, scaling)

    @property
    def local_rope(self) -> Optional[RopeConfig]:
        if self.local_rope_theta is None:
            return None
        return RopeConfig(self.local_rope_theta, self.head_dim, self.max_seq_len)

    def is_global(self, layer_id: int) -> bool:
        return (layer_id + 1) % self.global_every == 0

    def layer_span(self, layer_id: int) -> Optional[AttentionSpan]:
        return None if self.is_global(layer_id) else AttentionSpan(window=self.sliding_window)

    def validate(self) -> None:
        super().validate()
        no_llama3_scaling(self.rope_scaling_factor)


# From the config.json of each release on the Hugging Face hub (google/gemma-3-*-pt, text_config).
_G4 = GemmaArgs(dim=2560, n_layers=34, n_heads=8, n_kv_heads=4, head_dim_override=256, vocab_size=262208,
                ffn_hidden_dim=10240, rope_linear_factor=8.0)
FLAVORS: dict[str, GemmaArgs] = {
    # every feature of the family: wider heads than dim / n_heads, 5 local : 1 global, a window shorter than the
    # default run's sequences
    "debug": replace(_G4, dim=256, n_layers=6, n_heads=4, n_kv_heads=2, head_dim_override=128, vocab_size=8192,
                     ffn_hidden_dim=704, query_pre_attn_scalar=128, sliding_window=64, max_seq_len=2048),
    "1B": replace(_G4, dim=1152, n_layers=26, n_heads=4, n_kv_heads=1, vocab_size=262144, ffn_hidden_dim=6912,
                  sliding_window=512, rope_linear_factor=None, max_seq_len=32768),
    "4B": _G4,
    "12B": replace(_G4, dim=3840, n_layers=48, n_heads=16, n_kv_heads=8, ffn_hidden_dim=15360),
    "27B": replace(_G4, dim=5376, n_layers=62, n_heads=32, n_kv_heads=16, head_dim_override=128, ffn_hidden_dim=21504,
                   query_pre_attn_scalar=168),
}
# Gemma 2 (google/gemma-2-*): local and global layers alternate, one RoPE base, no q/k norms, soft-capping.
_G2 = GemmaArgs(dim=2304, n_layers=26, n_heads=8, n_kv_heads=4, head_dim_override=256, vocab_size=256000,
                ffn_hidden_dim=9216, sliding_window=4096, global_every=2, rope_theta=10_000.0, local_rope_theta=None,
                qk_norm=False, attn_softcap=50.0, final_softcap=30.0, max_seq_len=8192)
GEMMA2_FLAVORS: dict[str, GemmaArgs] = {
    "debug": replace(_G2, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim_override=128, vocab_size=8192,
                     ffn_hidden_dim=704, query_pre_attn_scalar=128, sliding_window=64, max_seq_len=2048),
    "2B": _G2,
    "9B": replace(_G2, dim=3584, n_layers=42, n_heads=16, n_kv_heads=8, ffn_hidden_dim=14336),
    "27B": replace(_G2, dim=4608, n_layers=46, n_heads=32, n_kv_heads=16, head_dim_override=128, ffn_hidden_dim=36864,
                   query_pre_attn_scalar=144),
}
