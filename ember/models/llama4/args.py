"""Llama 4 (text) hyper-parameters and the published sizes (FLAVORS)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from ember.models.checks import check_non_negative, check_top_k, require_expert_layers
from ember.nn.args import GroupedQueryArgs
from ember.nn.attention import AttentionSpan
from ember.nn.rope import RopeConfig, llama3_rope


@dataclass(frozen=True, kw_only=True)
class Llama4Args(GroupedQueryArgs):
    ffn_hidden_dim: int  # the dense layers' SwiGLU hidden size (config.json's intermediate_size_mlp)
    # The mixture of experts: n_experts SwiGLU experts of moe_hidden_dim (intermediate_size), top_k of them chosen by
    # sigmoid scores that scale each expert's input, plus a shared expert of the same size every token passes through.
    # Layer i has experts when (i + 1) % sparse_step == 0 (interleave_moe_layer_step: Scout 1, Maverick 2;
    # Qwen3-MoE's rule).
    n_experts: int = 16
    top_k: int = 1
    moe_hidden_dim: int
    sparse_step: int = 1
    # iRoPE: layer i has no rotary embedding when (i + 1) % nope_every == 0 (no_rope_layer_interval); the RoPE layers
    # attend within chunks of attention_chunk positions (None: causal) and L2-normalise q and k (use_qk_norm).
    nope_every: int = 4
    attention_chunk: Optional[int] = 8192
    qk_norm: bool = True
    # Attention temperature tuning on the NoPE layers: q is scaled by log1p(floor((pos + 1) / floor_scale)) *
    # attn_scale + 1, so attention stays sharp at long range (attn_temperature_tuning, floor_scale, attn_scale).
    temperature_tuning: bool = True
    floor_scale: int = 8192
    attn_scale: float = 0.1
    norm_eps: float = 1e-5
    rope_theta: float = 500_000.0
    # Llama 3.1 frequency scaling (HF rope_type "llama3"; Scout's); factor None: off (Maverick).
    rope_scaling_factor: Optional[float] = None
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 1.0
    rope_original_max_seq_len: int = 8192
    # The RoPE tables' length. The checkpoints state 10M (Scout) and 1M (Maverick) positions, whose tables would
    # be 5 GB and 0.5 GB per rank; the flavors hold 256K. Set model.max_seq_len to go further.
    max_seq_len: int = 262144
    tie_embeddings: bool = False

    @property
    def rope(self) -> RopeConfig:
        return llama3_rope(self.rope_theta, self.head_dim, self.max_seq_len, self.rope_scaling_factor,
                           self.rope_low_freq_factor, self.rope_high_freq_factor, self.rope_original_max_seq_len)

    def uses_rope(self, layer_id: int) -> bool:
        return (layer_id + 1) % self.nope_every != 0

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.n_experts > 0 and (layer_id + 1) % self.sparse_step == 0

    def validate(self) -> None:
        """What must fit together, after the floors (models/checks.py): some layer has experts, the heads split,
        and the temperature's slope is a number."""
        check_top_k(self.n_experts, self.top_k)
        require_expert_layers(self, self.n_experts, "sparse_step", self.sparse_step,
                              "layer i has them when (i + 1) % sparse_step == 0", "1 to n_layers")
        super().validate()
        check_non_negative("attn_scale", self.attn_scale)

    def layer_span(self, layer_id: int) -> Optional[AttentionSpan]:
        if self.attention_chunk is None or not self.uses_rope(layer_id):
            return None
        return AttentionSpan(chunk=self.attention_chunk)


# From the text_config of each release on the Hugging Face hub (meta-llama/Llama-4-*-17B-*E).
_SCOUT = Llama4Args(dim=5120, n_layers=48, n_heads=40, n_kv_heads=8, head_dim_override=128, vocab_size=202048,
                    ffn_hidden_dim=16384, n_experts=16, moe_hidden_dim=8192, rope_scaling_factor=16.0)
FLAVORS: dict[str, Llama4Args] = {
    # every feature of the family at CPU size: MoE and dense layers interleaved, a NoPE layer in every four, chunks
    # shorter than the default run's sequences, temperature tuning that changes within them
    "debug": replace(_SCOUT, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim_override=None, vocab_size=8192,
                     ffn_hidden_dim=704, n_experts=8, moe_hidden_dim=256, sparse_step=2, attention_chunk=64,
                     floor_scale=32, rope_scaling_factor=None, max_seq_len=2048),
    "Scout-17B-16E": _SCOUT,
    "Maverick-17B-128E": replace(_SCOUT, n_experts=128, sparse_step=2, qk_norm=False, rope_scaling_factor=None),
}
