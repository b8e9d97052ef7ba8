"""GLaM hyper-parameters and the sizes of the Pax GLaM configs (FLAVORS)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ember.models.checks import check_top_k, no_llama3_scaling
from ember.nn.args import DecoderArgs
from ember.nn.rope import RopeConfig


@dataclass(frozen=True, kw_only=True)
class GlamArgs(DecoderArgs):
    # The FFN hidden size, the same for the dense layers' gated-GELU FFN and for each expert (Pax's
    # GlamUniTransformerLmHParams takes ff_dim and moe_hidden_dim; every GLaM config sets them equal).
    ffn_hidden_dim: int
    n_experts: int = 64
    top_k: int = 2
    # Layer i is a MoE layer when i % moe_every == 0: with 2, layers 0, 2, 4, ... (Pax builds GLaM from
    # two-layer blocks whose first layer is the MoE one: moe_layers = [0] of each block; pipelined, it
    # uses range(0, num_layers, 2)). The GLaM paper replaces "every other" layer's FFN (Du et al. 2022, sec. 3).
    moe_every: int = 2
    norm_eps: float = 1e-6  # praxis RmsNorm's default epsilon
    rope_theta: float = 10000.0
    max_seq_len: int = 2048  # Pax's MAX_SEQ_LEN; the RoPE tables cover this many positions
    # The output projection is the token embedding (Pax: GShardSharedEmbeddingSoftmax, one [V, M] matrix).
    tie_embeddings: bool = True
    rope_scaling_factor: Optional[float] = None  # kept for model.json's key: GLaM's RoPE has no scaling

    @property
    def rope(self) -> RopeConfig:
        return RopeConfig(self.rope_theta, self.head_dim, self.max_seq_len)

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id % self.moe_every == 0

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    def validate(self) -> None:
        check_top_k(self.n_experts, self.top_k)
        super().validate()
        no_llama3_scaling(self.rope_scaling_factor)


# Sizes of the GLaM configs NVIDIA benchmarks with Pax (JAX-Toolbox rosetta/projects/pax README, "Mixture of
# Experts": "126M/64E (126M base dense model, 64 experts, ~1.9B parameters) and 64B/64E (~1.14T
# parameters)"), whose bases are the GLaM paper's (Du et al. 2022, Table 4): 0.1B: 12 layers, d_model 768,
# FFN 3072, 12 heads of 64; 64B: 64 layers, d_model 8192, FFN 32768, heads of 128. 64B/64E has 64 heads of
# 128 = d_model as in Pax's GLaM64B64EProxy (paxml/tasks/lm/params/nvidia.py: attention_key_value_dim =
# MODEL_DIMS // NUM_HEADS), which with the vocabulary gives the README's 1.14T (the paper's 128 heads and
# 256k vocabulary give its 1.2T). The vocabulary is Pax's GPU configs' 50,304 (GPT126M: the C4 SentencePiece
# model padded to a multiple of 64).
FLAVORS: dict[str, GlamArgs] = {
    # A tiny GLaM that trains in minutes on a laptop CPU; vocab 8192 fits the embedded corpus tokenizer.
    "debug": GlamArgs(dim=256, n_layers=4, n_heads=8, vocab_size=8192, ffn_hidden_dim=512, n_experts=8, top_k=2),
    "126M-64E": GlamArgs(dim=768, n_layers=12, n_heads=12, vocab_size=50304, ffn_hidden_dim=3072),
    "64B-64E": GlamArgs(dim=8192, n_layers=64, n_heads=64, vocab_size=50304, ffn_hidden_dim=32768),
}
