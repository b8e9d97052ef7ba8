"""Phi-3: published sizes, and parity with transformers' Phi3ForCausalLM (logits, gradients, greedy generation
past the window, a bit-exact round trip through the fused qkv_proj and gate_up_proj)."""

from pathlib import Path

import pytest
import torch
import transformers

from ember.models.phi3 import FLAVORS, Transformer, num_params
from tests.models.hf_parity import assert_counts_equal_transformers, assert_parity


def test_published_sizes_equal_transformers_counts():
    assert_counts_equal_transformers("phi3")
    with torch.device("meta"):
        assert round(num_params(Transformer(FLAVORS["mini-4k"])) / 1e9, 2) == 3.82
        assert round(num_params(Transformer(FLAVORS["medium-4k"])) / 1e9, 2) == 13.96


@pytest.mark.parametrize("window, kv_heads", [(5, 2), (None, 4)])
def test_matches_transformers(tmp_path: Path, window, kv_heads):
    config = transformers.Phi3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                                     num_key_value_heads=kv_heads, vocab_size=128, max_position_embeddings=64,
                                     original_max_position_embeddings=64, sliding_window=window, pad_token_id=None,
                                     bos_token_id=None, eos_token_id=None)
    ours = assert_parity(transformers.Phi3ForCausalLM, config, tmp_path, "phi3")
    assert ours.args.sliding_window == window


def test_the_128k_models_longrope_is_refused_naming_it(tmp_path: Path):
    from ember.models.phi3 import hf

    config = hf.hf_config_from_args(FLAVORS["debug"])
    config["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 16,
                                 "long_factor": [2.0] * 16}
    with pytest.raises(ValueError, match="LongRoPE.*not supported yet"):
        hf.args_from_hf_config(config)
