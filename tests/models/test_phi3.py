"""Phi-3: published sizes, and parity with transformers' Phi3ForCausalLM (logits, gradients, greedy generation
past the window, a bit-exact round trip through the fused qkv_proj and gate_up_proj)."""

import math
from pathlib import Path

import pytest
import torch
import transformers

from ember.model_io.load import load_model
from ember.models.phi3 import FLAVORS, Transformer, hf, num_params
from ember.train import run as run_lib
from ember.train.trainer import Trainer
from tests.models.hf_parity import assert_counts_equal_transformers, assert_parity, random_hf_model


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


LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [1.5 + 0.4 * i for i in range(8)], "original_max_position_embeddings": 16}


@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_longrope_and_partial_rotary_match_transformers(tmp_path: Path, partial: float):
    """The 128K models' LongRoPE: short factors while the sequence stays within 16 positions, long ones past it
    (the 24-token forward and the 30-token generation), q and k scaled by the attention factor; with 0.5, RoPE on
    the first half of each head only (Phi-4-mini's partial rotary embedding, at 0.75 there)."""
    rope = {**LONGROPE, "partial_rotary_factor": partial}
    if partial != 1.0:
        rope["short_factor"], rope["long_factor"] = rope["short_factor"][:4], rope["long_factor"][:4]
    config = transformers.Phi3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                                     original_max_position_embeddings=16, rope_parameters=rope, pad_token_id=None,
                                     bos_token_id=None, eos_token_id=None)
    ours = assert_parity(transformers.Phi3ForCausalLM, config, tmp_path, "phi3")
    assert ours.args.rotary_dim == int(16 * partial) and ours.args.rope_long_factor == tuple(rope["long_factor"])
    # within the original window the short factors serve: a 12-token forward equals transformers' too
    tokens = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(4))
    reference = transformers.Phi3ForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), reference(tokens).logits, rtol=1e-4, atol=1e-4)


def test_init_from_a_phi3_directory_trains_from_its_logits(tmp_path: Path):
    """model.init_from=<Phi-3 HF directory> streams the fused qkv_proj and gate_up_proj into the run's model (it once
    crashed there): before the first step the run's logits are transformers', and then it trains."""
    config = transformers.Phi3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=512, max_position_embeddings=64,
                                     original_max_position_embeddings=64, pad_token_id=None, bos_token_id=None,
                                     eos_token_id=None)
    reference = random_hf_model(transformers.Phi3ForCausalLM, config, tmp_path / "hf")
    trainer = Trainer(run_lib.load_config("debug", [
        f"model.init_from={tmp_path / 'hf'}", "data.dataset=synthetic", "seq_len=32", "global_batch_size=4",
        "micro_batch_size=4", "max_steps=2", "precision=fp32", "eval_batches=1", "metrics.console=false",
        "metrics.tensorboard=false", f"output_dir={tmp_path / 'run'}"]))
    assert trainer.spec.args == hf.args_from_hf_config(config.to_dict())
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(trainer.model(tokens), reference(tokens).logits, rtol=1e-4, atol=1e-4)
    before = {k: v.clone() for k, v in load_model(tmp_path / "hf").state_dict().items()}
    summary = trainer.train()
    assert summary["steps"] == 2 and math.isfinite(summary["first_loss"]) and math.isfinite(summary["final_loss"])
    after = load_model(tmp_path / "run").state_dict()
    assert all(not torch.equal(after[k], before[k]) for k in before if k.endswith("attention.wq.weight"))
