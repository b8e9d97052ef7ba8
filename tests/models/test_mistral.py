"""Mistral: published sizes, and parity with transformers' MistralForCausalLM (logits, gradients, greedy
generation past the window, a bit-exact round trip) with a sliding window shorter than the sequence."""

from pathlib import Path

import pytest
import torch
import transformers

from ember.models.mistral import FLAVORS, Transformer, num_params
from tests.models.hf_parity import assert_counts_equal_transformers, assert_parity


def test_published_sizes_equal_transformers_counts():
    assert_counts_equal_transformers("mistral")
    with torch.device("meta"):
        assert round(num_params(Transformer(FLAVORS["7B"])) / 1e9, 2) == 7.24
        assert round(num_params(Transformer(FLAVORS["7B-v0.3"])) / 1e9, 2) == 7.25
        assert round(num_params(Transformer(FLAVORS["Nemo-12B"])) / 1e9, 2) == 12.25


@pytest.mark.parametrize("window", [5, None])
def test_matches_transformers(tmp_path: Path, window):
    config = transformers.MistralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                        max_position_embeddings=64,
                                        rope_theta=10000.0, sliding_window=window)
    ours = assert_parity(transformers.MistralForCausalLM, config, tmp_path, "mistral")
    assert ours.args.sliding_window == window
