"""Mixtral hyper-parameters and the published sizes (FLAVORS)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from ember.nn.decoder import HeadShape


@dataclass(frozen=True, kw_only=True)
class MixtralArgs(HeadShape):
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: Optional[int] = None
    vocab_size: int
    ffn_hidden_dim: int  # each expert's SwiGLU hidden size (Mixtral states it outright)
    n_experts: int = 8
    top_k: int = 2
    norm_eps: float = 1e-5
    rope_theta: float = 1e6
    max_seq_len: int = 32768
    tie_embeddings: bool = False
    # Present so that the Llama attention and RoPE code, which Mixtral shares, reads them: no scaling.
    rope_scaling_factor: Optional[float] = None
    head_dim_override: Optional[int] = None  # each head's width where not dim / n_heads: `model.head_dim`

    CONFIG_KEYS: ClassVar[dict[str, str]] = {"head_dim": "head_dim_override"}




# Values from the params.json / config.json of Mistral AI's releases.
FLAVORS: dict[str, MixtralArgs] = {
    "debug": MixtralArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=8192, ffn_hidden_dim=448,
                         n_experts=8, top_k=2, max_seq_len=2048),
    "8x7B": MixtralArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000, ffn_hidden_dim=14336),
    "8x22B": MixtralArgs(dim=6144, n_layers=56, n_heads=48, n_kv_heads=8, vocab_size=32768, ffn_hidden_dim=16384,
                         max_seq_len=65536),
}
