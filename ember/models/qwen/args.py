"""Qwen hyper-parameters (Qwen2/2.5, Qwen3 dense, Qwen3-MoE) and the published sizes (FLAVORS), by family."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace
from typing import Optional

from ember.errors import ConfigError
from ember.models.checks import check_top_k, no_llama3_scaling, require_expert_layers
from ember.nn.args import GroupedQueryArgs
from ember.nn.attention import AttentionSpan
from ember.nn.rope import RopeConfig


@dataclass(frozen=True, kw_only=True)
class QwenArgs(GroupedQueryArgs):
    ffn_hidden_dim: int  # the dense SwiGLU's hidden size (config.json's intermediate_size)
    qkv_bias: bool = False  # biases on the q, k, v projections (Qwen2/2.5)
    qk_norm: bool = False  # RMSNorm over each head's width on q and k before RoPE (Qwen3)
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 32768
    tie_embeddings: bool = False
    # Sliding-window attention on the layers from max_window_layers on (config.json's use_sliding_window,
    # sliding_window, max_window_layers); None: every layer attends to its whole causal context. No published
    # Qwen2.5 or Qwen3 checkpoint turns it on.
    sliding_window: Optional[int] = None
    max_window_layers: int = 0
    # A mixture of experts (Qwen3-MoE): 0 experts is a dense model. Layer i has experts unless it is in
    # dense_layers (mlp_only_layers) or (i + 1) is not a multiple of sparse_step (decoder_sparse_step).
    n_experts: int = 0
    top_k: int = 8
    moe_hidden_dim: int = 0  # each expert's SwiGLU hidden size (moe_intermediate_size)
    norm_topk_prob: bool = True  # the top-k routing weights renormalised to sum to 1
    sparse_step: int = 1
    dense_layers: tuple[int, ...] = ()
    rope_scaling_factor: Optional[float] = None  # kept for model.json's key: Qwen's RoPE has no Llama 3.1 scaling

    @property
    def rope(self) -> RopeConfig:
        return RopeConfig(self.rope_theta, self.head_dim, self.max_seq_len)

    def layer_span(self, layer_id: int) -> Optional[AttentionSpan]:
        if self.sliding_window is None or layer_id < self.max_window_layers:
            return None
        return AttentionSpan(window=self.sliding_window)

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.n_experts > 0 and layer_id not in self.dense_layers and (layer_id + 1) % self.sparse_step == 0

    def validate(self) -> None:
        """What must fit together, after the floors (models/checks.py): experts have a width and some layer has
        them, the heads split, and the sliding window starts at a layer there is."""
        check_top_k(self.n_experts, self.top_k)
        if self.n_experts and self.moe_hidden_dim < 1:
            raise ConfigError(f"model.moe_hidden_dim={self.moe_hidden_dim} must be >= 1 with model.n_experts="
                              f"{self.n_experts} (each expert's SwiGLU hidden size); "
                              "set model.moe_hidden_dim to 1 or more")
        require_expert_layers(self, self.n_experts, "sparse_step", self.sparse_step,
                              "layer i has them when (i + 1) % sparse_step == 0", "1 to n_layers")
        super().validate()
        first, window = self.max_window_layers, self.sliding_window  # the window is >= 1 where set (the floors)
        if first < 0 or (first and window is None) or (window is not None and first >= self.n_layers):
            raise ConfigError(f"model.max_window_layers={first} must be the first layer with the sliding window: "
                              f">= 0, below model.n_layers={self.n_layers}, and with model.sliding_window set")
        no_llama3_scaling(self.rope_scaling_factor)


# The experts' keys, which Qwen's dense families (qwen2, qwen3) have as fields of the shared QwenArgs but not as
# hyper-parameters of theirs
_MOE_KEYS = frozenset({"moe_hidden_dim", "norm_topk_prob", "sparse_step", "top_k"})


def check_family(family: str, keys: Collection[str], args: QwenArgs) -> None:
    """One QwenArgs class serves three families: experts make qwen3_moe, and qwen2/qwen3 are dense. `keys`: the
    model.* keys the user set, which made `args` from the family's flavor."""
    moe_keys = sorted(_MOE_KEYS & set(keys))
    if family != "qwen3_moe" and moe_keys:
        raise ConfigError(f"model.{moe_keys[0]} is a Qwen3-MoE hyper-parameter, and {family} has no experts; "
                          "use model.family=qwen3_moe")
    if (family == "qwen3_moe") != bool(args.n_experts):
        raise ConfigError(f"model.n_experts={args.n_experts} does not fit model.family={family}: experts make "
                          "qwen3_moe, and qwen2/qwen3 are dense; choose the family that has them")


# From the config.json of each release on the Hugging Face hub (Qwen/Qwen2.5-*, Qwen/Qwen3-*).
_QWEN25 = QwenArgs(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, vocab_size=151936, ffn_hidden_dim=4864,
                   qkv_bias=True, max_seq_len=32768, tie_embeddings=True)
_QWEN3 = QwenArgs(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, vocab_size=151936, ffn_hidden_dim=3072,
                  head_dim_override=128, qk_norm=True, max_seq_len=40960, tie_embeddings=True)
_QWEN3_MOE = replace(_QWEN3, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, ffn_hidden_dim=6144,
                     tie_embeddings=False, n_experts=128, top_k=8, moe_hidden_dim=768)
# Small enough to train on a laptop CPU, with every feature of its family (GQA, and for Qwen3 heads wider
# than dim / n_heads, as in 0.6B-4B).
_DEBUG = dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=8192, ffn_hidden_dim=704, max_seq_len=2048)

FLAVORS: dict[str, dict[str, QwenArgs]] = {
    "qwen2": {
        "debug": replace(_QWEN25, **_DEBUG),
        "0.5B": _QWEN25,
        "1.5B": replace(_QWEN25, dim=1536, n_layers=28, n_heads=12, ffn_hidden_dim=8960),
        "3B": replace(_QWEN25, dim=2048, n_layers=36, n_heads=16, ffn_hidden_dim=11008),
        "7B": replace(_QWEN25, dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, ffn_hidden_dim=18944,
                      vocab_size=152064, tie_embeddings=False),
        "14B": replace(_QWEN25, dim=5120, n_layers=48, n_heads=40, n_kv_heads=8, ffn_hidden_dim=13824,
                       vocab_size=152064, tie_embeddings=False),
        "32B": replace(_QWEN25, dim=5120, n_layers=64, n_heads=40, n_kv_heads=8, ffn_hidden_dim=27648,
                       vocab_size=152064, tie_embeddings=False),
        "72B": replace(_QWEN25, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden_dim=29568,
                       vocab_size=152064, tie_embeddings=False),
    },
    "qwen3": {
        "debug": replace(_QWEN3, **_DEBUG, head_dim_override=64),
        "0.6B": _QWEN3,
        "1.7B": replace(_QWEN3, dim=2048, ffn_hidden_dim=6144),
        "4B": replace(_QWEN3, dim=2560, n_layers=36, n_heads=32, ffn_hidden_dim=9728),
        "8B": replace(_QWEN3, dim=4096, n_layers=36, n_heads=32, ffn_hidden_dim=12288, head_dim_override=None,
                      tie_embeddings=False),
        "14B": replace(_QWEN3, dim=5120, n_layers=40, n_heads=40, ffn_hidden_dim=17408, head_dim_override=None,
                       tie_embeddings=False),
        "32B": replace(_QWEN3, dim=5120, n_layers=64, n_heads=64, ffn_hidden_dim=25600, tie_embeddings=False),
    },
    "qwen3_moe": {
        "debug": replace(_QWEN3_MOE, **_DEBUG, head_dim_override=64, n_experts=16, top_k=4, moe_hidden_dim=128),
        "30B-A3B": _QWEN3_MOE,
        "235B-A22B": replace(_QWEN3_MOE, dim=4096, n_layers=94, n_heads=64, ffn_hidden_dim=12288, moe_hidden_dim=1536),
    },
}
