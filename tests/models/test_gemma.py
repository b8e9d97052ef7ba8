"""Gemma 3 (text): published sizes, and parity with transformers' Gemma3ForCausalLM (logits, gradients, greedy
generation past the window, a bit-exact round trip): (1 + w) norms around attention and feed-forward, GeGLU, the
sqrt(dim) embedding scale, q/k norms, query_pre_attn_scalar, 5 local : 1 global layers with their own RoPE."""

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from ember.model_io.hf_directory import load_hf_model
from ember.model_io.load import load_hf_weights
from ember.models.gemma import FLAVORS, Transformer, flops_per_token, hf, num_params
from tests.models.hf_parity import assert_counts_equal_transformers, assert_parity, random_hf_model

GLOBAL_ROPE = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}


def _config(**overrides) -> transformers.Gemma3TextConfig:
    settings = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, vocab_size=128, max_position_embeddings=64, sliding_window=5,
                    query_pre_attn_scalar=24, pad_token_id=None, bos_token_id=None, eos_token_id=None,
                    rope_parameters={"full_attention": GLOBAL_ROPE,
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    return transformers.Gemma3TextConfig(**{**settings, **overrides})


def test_published_sizes_equal_transformers_counts():
    assert_counts_equal_transformers("gemma3")
    for flavor, billions in {"1B": 1.00, "4B": 3.88, "12B": 11.77, "27B": 27.01}.items():
        with torch.device("meta"):
            assert round(num_params(Transformer(FLAVORS[flavor])) / 1e9, 2) == billions, flavor


def test_matches_transformers(tmp_path: Path):
    ours = assert_parity(transformers.Gemma3ForCausalLM, _config(), tmp_path, "gemma3")
    # layers 0-4 local (window 5, base 10,000), layer 5 global (whole context, base 1e6 / 8)
    assert [block.rope_table for block in ours.layers.values()] == ["_local"] * 5 + [""]
    assert [block.attention.span is None for block in ours.layers.values()] == [False] * 5 + [True]
    assert ours.args.rope_linear_factor == 8.0 and ours.args.query_pre_attn_scalar == 24


def test_the_27b_layout_matches_transformers(tmp_path: Path):
    # heads narrower than dim / n_heads, a scalar that is not head_dim, default RoPE on the global layers
    config = _config(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     query_pre_attn_scalar=21, rope_parameters=None)
    assert_parity(transformers.Gemma3ForCausalLM, config, tmp_path, "gemma3")


def test_flops_count_the_local_windows():
    args = FLAVORS["27B"]
    dense = 12 * args.n_layers * args.n_heads * args.head_dim * 8192
    assert flops_per_token(args, 8192) < flops_per_token(args, 1024) * 8  # windows make attention sub-quadratic
    assert flops_per_token(args, 1024) - flops_per_token(args, 8192) + dense > 0


def test_gemma2_published_sizes_equal_transformers_counts():
    from ember.models.gemma import GEMMA2_FLAVORS

    assert_counts_equal_transformers("gemma2")
    for flavor, billions in {"2B": 2.61, "9B": 9.24, "27B": 27.23}.items():
        with torch.device("meta"):
            assert round(num_params(Transformer(GEMMA2_FLAVORS[flavor])) / 1e9, 2) == billions, flavor


def test_gemma2_soft_capping_matches_transformers(tmp_path: Path):
    """Gemma 2: alternating local/global layers on one RoPE base, no q/k norms, the attention scores capped at
    50 tanh(s / 50) and the logits at 30 tanh(l / 30); caps low enough here (5, 3) that they bite."""
    config = transformers.Gemma2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=32, vocab_size=128, max_position_embeddings=64,
                                       sliding_window=5, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                                       final_logit_softcapping=3.0, pad_token_id=None, bos_token_id=None,
                                       eos_token_id=None)
    ours = assert_parity(transformers.Gemma2ForCausalLM, config, tmp_path, "gemma2")
    assert (ours.args.attn_softcap, ours.args.final_softcap, ours.args.qk_norm) == (5.0, 3.0, False)
    tokens = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert ours(tokens).abs().max() < 3.0  # the logits' cap


# The shape of the hub's gemma-3-4b config.json (written by transformers 4.50): a text_config holding only what differs
# from Gemma3TextConfig's defaults, here as there 8 query heads, 4 K/V heads of 256 and a query scalar of 256.
HUB_TEXT_CONFIG = {"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6,
                   "vocab_size": 256, "sliding_window": 8, "max_position_embeddings": 64,
                   "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}


@pytest.mark.parametrize("naming", ["language_model.model.", "model.language_model."])
def test_multimodal_checkpoint_loads_its_text_model(tmp_path: Path, naming: str):
    """Gemma 3 4B-27B on the hub are Gemma3ForConditionalGeneration (model_type gemma3): the text hyper-parameters in
    text_config, the text weights under language_model.model. (as save_pretrained writes them; transformers 5 names
    them model.language_model. in memory, as other tools may write them), a vision tower and projector beside them.
    ember reads the text model: its logits are the multimodal model's fed text only, loaded whole or streamed."""
    text = _config(**{k: v for k, v in HUB_TEXT_CONFIG.items() if k not in ("model_type", "rope_scaling")},
                   num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                       mm_tokens_per_image=4)
    random_hf_model(transformers.Gemma3ForConditionalGeneration, config, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**written, "text_config": HUB_TEXT_CONFIG}))
    weights = load_file(tmp_path / "model.safetensors")
    assert any(k.startswith("language_model.model.layers.") for k in weights) and "lm_head.weight" not in weights
    if naming == "model.language_model.":  # transformers 5's own names, which it reads as well
        save_file({k.replace("language_model.model.", naming) if k.startswith("language_model.") else f"model.{k}": v
                   for k, v in weights.items()}, tmp_path / "model.safetensors")
    reference = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32).eval()

    ours = load_hf_model(tmp_path, "cpu", torch.float32).eval()
    assert ours.args == hf.args_from_hf_config(text.to_dict())  # the defaults text_config leaves out filled in
    assert (ours.args.n_heads, ours.args.kv_heads, ours.args.head_dim, ours.args.rope_linear_factor) == (8, 4, 256, 8.0)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(input_ids=tokens).logits
        torch.testing.assert_close(ours(tokens), expected, rtol=1e-4, atol=1e-4)
        streamed = Transformer(ours.args)  # model.init_from's path: tensor by tensor into a built model
        load_hf_weights(streamed, tmp_path)
        streamed.init_rope(torch.device("cpu"))
        torch.testing.assert_close(streamed.eval()(tokens), expected, rtol=1e-4, atol=1e-4)
