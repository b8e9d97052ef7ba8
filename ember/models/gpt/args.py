"""GPT hyper-parameters and the sizes of the Pax GPT configs (FLAVORS)."""

from __future__ import annotations

from dataclasses import dataclass

from ember.nn.args import DecoderArgs


@dataclass(frozen=True, kw_only=True)
class GPTArgs(DecoderArgs):
    """No RoPE (DecoderArgs.rope is None): a learned position table of max_seq_len rows, so no sequence can be
    longer."""

    ffn_hidden_dim: int  # the GELU MLP's hidden size (4 x dim in every GPT-2/3 size)
    norm_eps: float = 1e-5
    tie_embeddings: bool = True  # the output projection reuses the token embedding (Pax, GPT-2, GPT-3)
    init_std: float = 0.02  # std of the Gaussian weight init (Pax's INIT_STD; GPT-2's initializer_range)


# Sizes from Pax's GPU configs (google/paxml, paxml/contrib/gpu/scripts_gpu/configs.py: GPT126M, GPT5B,
# GPT175B, the configs NVIDIA's JAX-Toolbox rosetta/projects/pax README benchmarks): NUM_LAYERS,
# NUM_HEADS, MODEL_DIMS, HIDDEN_DIMS, VOCAB_SIZE, MAX_SEQ_LEN (= TRAINABLE_PE_MAX_SEQ_LEN, the learned
# position table), LAYERNORM_EPSILON 1e-5 and INIT_STD. All three share the embedding with the softmax
# (SEPARATE_EMBEDDING = False), use biases (USE_BIAS), tanh-approximated GELU and no gated MLP.
# 126M and 5B pad GPT-2's 50,257-token vocabulary to 50,304 (a multiple of 64); 175B keeps 50,257.
FLAVORS: dict[str, GPTArgs] = {
    # A tiny GPT that trains in minutes on a laptop CPU; vocab 8192 fits the embedded corpus tokenizer.
    "debug": GPTArgs(dim=256, n_layers=4, n_heads=8, vocab_size=8192, ffn_hidden_dim=1024, max_seq_len=2048),
    "126M": GPTArgs(dim=768, n_layers=12, n_heads=12, vocab_size=50304, ffn_hidden_dim=3072, max_seq_len=2048,
                    init_std=0.023),
    "5B": GPTArgs(dim=4096, n_layers=24, n_heads=32, vocab_size=50304, ffn_hidden_dim=16384, max_seq_len=2048,
                  init_std=0.01),
    # GPT-3 175B (Brown et al. 2020, Table 2.1: 96 layers, d_model 12288, 96 heads of 128). Pax's GPT175B
    # inherits INIT_STD 0.023 from its 126M config.
    "175B": GPTArgs(dim=12288, n_layers=96, n_heads=96, vocab_size=50257, ffn_hidden_dim=49152, max_seq_len=2048,
                    init_std=0.023),
}
