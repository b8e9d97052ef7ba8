"""Llama hyper-parameters and the published sizes (FLAVORS), by family then flavor."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar, Optional

from ember.nn.args import GroupedQueryArgs
from ember.nn.rope import RopeConfig, llama3_rope


@dataclass(frozen=True, kw_only=True)
class LlamaArgs(GroupedQueryArgs):
    multiple_of: int = 256  # the SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: Optional[float] = None
    # The SwiGLU hidden size stated outright. Every Meta release is expressed by the formula in
    # `ffn_hidden_dim`; a Hugging Face config states `intermediate_size`, which is kept verbatim here.
    ffn_hidden_dim_override: Optional[int] = None  # set by `model.ffn_hidden_dim` (see CONFIG_KEYS)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama 3.1 RoPE frequency scaling (Meta's `apply_scaling`, HF rope_type "llama3"); factor None: off.
    rope_scaling_factor: Optional[float] = None
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    tie_embeddings: bool = False  # the output projection reuses the token embedding matrix

    # `model.<key>` -> field, where the field is not named as the key every family shares: Llama's hidden size
    # is derived by Meta's rule unless set, so the field holds only the user's choice and the property below
    # the value (the field's name is kept: checkpoints' model.json files store it).
    CONFIG_KEYS: ClassVar[dict[str, str]] = {"ffn_hidden_dim": "ffn_hidden_dim_override",
                                             "head_dim": "head_dim_override"}

    @property
    def rope(self) -> RopeConfig:
        return llama3_rope(self.rope_theta, self.head_dim, self.max_seq_len, self.rope_scaling_factor,
                           self.rope_low_freq_factor, self.rope_high_freq_factor, self.rope_original_max_seq_len)

    @property
    def ffn_hidden_dim(self) -> int:
        if self.ffn_hidden_dim_override is not None:
            return self.ffn_hidden_dim_override
        # Meta's reference model.py: 2/3 of 4*dim (so SwiGLU's three matrices cost what a 4*dim MLP's
        # two do), times an optional multiplier, rounded up to multiple_of.
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


# Values from the params.json of each Meta release (github.com/meta-llama/llama, llama-models).
# The resulting SwiGLU sizes: Llama 2 7B 11008, 13B 13824, 70B 28672; Llama 3 8B 14336, 70B 28672;
# 3.1 405B 53248; 3.2 1B and 3B 8192.
_LLAMA2 = LlamaArgs(dim=4096, n_layers=32, n_heads=32, vocab_size=32000, max_seq_len=4096)
_LLAMA3 = LlamaArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=1024,
                    ffn_dim_multiplier=1.3, rope_theta=500000.0, max_seq_len=8192)
# 3.1 stretches RoPE from the 8k pre-training window to 128k (factor 8); 3.2 uses factor 32.
_LLAMA31 = replace(_LLAMA3, rope_scaling_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                   rope_original_max_seq_len=8192, max_seq_len=131072)
_LLAMA32 = replace(_LLAMA31, rope_scaling_factor=32.0, tie_embeddings=True, multiple_of=256)
# A tiny Llama 3 that trains in minutes on a laptop CPU; GQA (8 query, 4 K/V heads) so every path runs.
_DEBUG = dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=8192, multiple_of=64,
              ffn_dim_multiplier=None, rope_theta=500000.0, max_seq_len=2048)

FLAVORS: dict[str, dict[str, LlamaArgs]] = {
    "llama2": {
        "7B": _LLAMA2,
        "13B": replace(_LLAMA2, dim=5120, n_layers=40, n_heads=40),
        "70B": replace(_LLAMA2, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3,
                       multiple_of=4096),
    },
    "llama3": {
        "debug": replace(_LLAMA3, **_DEBUG),
        "8B": _LLAMA3,
        "70B": replace(_LLAMA3, dim=8192, n_layers=80, n_heads=64, multiple_of=4096),
    },
    "llama3.1": {
        "debug": replace(_LLAMA31, **_DEBUG),
        "8B": _LLAMA31,
        "70B": replace(_LLAMA31, dim=8192, n_layers=80, n_heads=64, multiple_of=4096),
        "405B": replace(_LLAMA31, dim=16384, n_layers=126, n_heads=128, ffn_dim_multiplier=1.2, multiple_of=4096),
    },
    "llama3.2": {
        "debug": replace(_LLAMA32, **_DEBUG),
        "1B": replace(_LLAMA32, dim=2048, n_layers=16, n_heads=32, ffn_dim_multiplier=1.5),
        "3B": replace(_LLAMA32, dim=3072, n_layers=28, n_heads=24, ffn_dim_multiplier=1.0),
    },
}
