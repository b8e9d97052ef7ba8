"""DeepSeek hyper-parameters (DeepSeek-V3 `deepseek_v3`, DeepSeek-V2 `deepseek_v2`) and the published sizes
(FLAVORS)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, Optional

from ember.errors import ConfigError
from ember.models.checks import check_non_negative, check_top_k, no_llama3_scaling, require_expert_layers
from ember.nn.args import DecoderArgs
from ember.nn.rope import RopeConfig
from ember.nn.yarn import YarnScaling, yarn_softmax_mscale


@dataclass(frozen=True, kw_only=True)
class DeepseekArgs(DecoderArgs):
    ffn_hidden_dim: int  # the dense layers' SwiGLU hidden size (config.json's intermediate_size)
    # Multi-head Latent Attention (ember/nn/mla.py)
    q_lora_rank: Optional[int] = None  # None: q straight from x (V2-Lite); else q's latent width (V3: 1536)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # How Hugging Face's V3 lays out the rope rows (rope_interleave): True, consecutive pairs, ember's own order;
    # False, half against half, permuted on import and export (hf.py). No effect on the model itself.
    rope_interleave: bool = True
    # The mixture of experts: every layer from n_dense_layers (first_k_dense_replace) on
    n_experts: int = 256
    top_k: int = 8
    moe_hidden_dim: int = 2048  # each routed expert's SwiGLU hidden size (moe_intermediate_size)
    n_shared_experts: int = 1  # one shared SwiGLU of n_shared_experts * moe_hidden_dim every token passes through
    n_dense_layers: int = 3
    score_func: str = "sigmoid"  # sigmoid (V3) | softmax (V2)
    n_groups: int = 8  # group-limited routing (n_group): experts chosen from the topk_groups best groups
    topk_groups: int = 4
    route_scale: float = 2.5  # routed_scaling_factor
    norm_topk_prob: bool = True
    score_bias: bool = True  # V3's e_score_correction_bias (aux-loss-free balancing)
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_seq_len: int = 163840
    tie_embeddings: bool = False
    # YaRN (ember/nn/yarn.py); yarn_factor None: plain RoPE
    yarn_factor: Optional[float] = 40.0
    yarn_original_max_seq_len: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: Optional[float] = 1.0
    yarn_mscale_all_dim: Optional[float] = 1.0
    yarn_attention_factor: Optional[float] = None
    yarn_truncate: bool = True
    rope_scaling_factor: Optional[float] = None  # kept for model.json's key: DeepSeek's scaling is YaRN

    AT_LEAST: ClassVar[dict[str, int]] = {"n_shared_experts": 0, "n_dense_layers": 0}  # counts that may be none

    @property
    def head_dim(self) -> int:
        """Each query and key head's width: the nope part and the rope part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def yarn(self) -> Optional[YarnScaling]:
        if self.yarn_factor is None:
            return None
        return YarnScaling(self.yarn_factor, self.yarn_original_max_seq_len, self.yarn_beta_fast, self.yarn_beta_slow,
                           self.yarn_mscale, self.yarn_mscale_all_dim, self.yarn_attention_factor, self.yarn_truncate)

    @property
    def rope(self) -> RopeConfig:  # the tables turn the rope part of each head only
        return RopeConfig(self.rope_theta, self.qk_rope_head_dim, self.max_seq_len, self.yarn)

    @property
    def softmax_scale_factor(self) -> float:  # YaRN's mscale(factor, mscale_all_dim) ** 2 on the softmax scale
        return yarn_softmax_mscale(self.yarn)

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.n_experts > 0 and layer_id >= self.n_dense_layers

    def validate(self) -> None:
        """What must fit together, after the floors (models/checks.py): the rope part's pairs, a layer with experts,
        and the router's groups (ConfigError naming the key and a fix)."""
        check_top_k(self.n_experts, self.top_k)
        rope = self.qk_rope_head_dim
        if rope % 2:
            raise ConfigError(f"model.qk_rope_head_dim={rope} must be even (RoPE turns pairs of it); use "
                              f"{' or '.join(str(v) for v in (rope - 1, rope + 1) if v >= 2)}")
        require_expert_layers(self, self.n_experts, "n_dense_layers", self.n_dense_layers,
                              "layers from n_dense_layers on have them",
                              f"0 to {self.n_layers - 1}, or raise model.n_layers")
        if self.n_experts:
            _check_groups(self)
        super().validate()
        check_non_negative("route_scale", self.route_scale)
        no_llama3_scaling(self.rope_scaling_factor)

    def check_head_shape(self) -> None:
        """None here: MLA's heads are sized by its own keys (qk_nope/qk_rope/v_head_dim), not by dim / n_heads."""


def _check_groups(args: DeepseekArgs) -> None:
    """Group-limited routing (ember/nn/router.py): the topk_groups best of n_groups groups, each of at least two
    experts (V3's group score sums each group's best two), holding at least top_k experts between them."""
    groups, chosen, experts, top_k = args.n_groups, args.topk_groups, args.n_experts, args.top_k
    if chosen > groups:
        raise ConfigError(f"model.topk_groups={chosen} must be at most model.n_groups={groups} (the groups experts are "
                          f"chosen from); lower model.topk_groups or raise model.n_groups")
    if groups == 1:
        return
    if experts % groups or experts // groups < 2:
        fits = [g for g in range(chosen, experts // 2 + 1)  # 1 is no grouping, where one group is chosen
                if experts % g == 0 and (g == 1 or top_k <= chosen * (experts // g))]
        named = ", ".join(map(str, fits[:-1])) + " or " * (len(fits) > 1) + str(fits[-1]) if fits else ""
        options = f"model.n_groups={named}, or " if fits else ""
        least = max(2 * groups, -(-top_k // chosen) * groups)
        raise ConfigError(f"model.n_groups={groups} does not split model.n_experts={experts} into groups of 2 or more "
                          f"experts; use {options}model.n_experts a multiple of {groups} of at least {least}")
    per_group = experts // groups
    if top_k > chosen * per_group:
        raise ConfigError(f"model.top_k={top_k} exceeds the {chosen * per_group} experts of the "
                          f"model.topk_groups={chosen} chosen groups ({per_group} each); "
                          f"use model.top_k <= {chosen * per_group} or raise "
                          f"model.topk_groups (up to model.n_groups={groups})")


# From config.json on the Hugging Face hub: deepseek-ai/DeepSeek-V3 (V3-0324, R1 share it) and DeepSeek-V2-Lite.
_V3 = DeepseekArgs(dim=7168, n_layers=61, n_heads=128, vocab_size=129280, ffn_hidden_dim=18432, q_lora_rank=1536)
_V2_LITE = DeepseekArgs(dim=2048, n_layers=27, n_heads=16, vocab_size=102400, ffn_hidden_dim=10944, q_lora_rank=None,
                        n_experts=64, top_k=6, moe_hidden_dim=1408, n_shared_experts=2, n_dense_layers=1,
                        score_func="softmax", n_groups=1, topk_groups=1, route_scale=1.0, norm_topk_prob=False,
                        score_bias=False, yarn_mscale=0.707, yarn_mscale_all_dim=0.707)
# Small enough for CPU tests, with every feature of its family: V3's q latent, groups, the score bias, a dense
# first layer, YaRN; V2's plain q and softmax routing.
_DEBUG = dict(dim=256, n_layers=4, n_heads=8, vocab_size=8192, ffn_hidden_dim=512, kv_lora_rank=64,
              qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_experts=16, moe_hidden_dim=128,
              n_dense_layers=1, max_seq_len=2048, yarn_original_max_seq_len=256, yarn_factor=8.0)

FLAVORS: dict[str, dict[str, DeepseekArgs]] = {
    "deepseek_v3": {
        "debug": replace(_V3, **_DEBUG, q_lora_rank=96, top_k=4, n_groups=4, topk_groups=2),
        "671B": _V3,
    },
    "deepseek_v2": {
        "debug": replace(_V2_LITE, **_DEBUG, top_k=4),
        "16B": _V2_LITE,
    },
}
