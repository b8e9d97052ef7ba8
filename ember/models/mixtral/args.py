"""Mixtral hyper-parameters and the published sizes (FLAVORS)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ember.models.checks import check_top_k, no_llama3_scaling
from ember.nn.args import GroupedQueryArgs
from ember.nn.rope import RopeConfig


@dataclass(frozen=True, kw_only=True)
class MixtralArgs(GroupedQueryArgs):
    ffn_hidden_dim: int  # each expert's SwiGLU hidden size (Mixtral states it outright)
    n_experts: int = 8
    top_k: int = 2
    norm_eps: float = 1e-5
    rope_theta: float = 1e6
    max_seq_len: int = 32768
    tie_embeddings: bool = False
    rope_scaling_factor: Optional[float] = None  # kept for model.json's key: Mixtral's RoPE has no scaling

    @property
    def rope(self) -> RopeConfig:
        return RopeConfig(self.rope_theta, self.head_dim, self.max_seq_len)

    def is_moe_layer(self, layer_id: int) -> bool:
        return True  # every block's feed-forward is the mixture

    def validate(self) -> None:
        check_top_k(self.n_experts, self.top_k)
        super().validate()
        no_llama3_scaling(self.rope_scaling_factor)


# Values from the params.json / config.json of Mistral AI's releases.
FLAVORS: dict[str, MixtralArgs] = {
    "debug": MixtralArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=8192, ffn_hidden_dim=448,
                         n_experts=8, top_k=2, max_seq_len=2048),
    "8x7B": MixtralArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000, ffn_hidden_dim=14336),
    "8x22B": MixtralArgs(dim=6144, n_layers=56, n_heads=48, n_kv_heads=8, vocab_size=32768, ffn_hidden_dim=16384,
                         max_seq_len=65536),
}
