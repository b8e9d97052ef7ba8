"""Llama 4 (text): published sizes, and parity with transformers' own Llama4ForCausalLM (logits, gradients, greedy
generation, a bit-exact round trip) on small random configs with every feature the family has: iRoPE (NoPE layers
with temperature tuning, chunked RoPE layers with L2 q/k norms), interleaved MoE layers with a shared expert and
input-scaled sigmoid top-1 routing."""

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from ember.errors import CheckpointError
from ember.model_io.hf_directory import hf_family, load_hf_model
from ember.models.llama4 import FLAVORS, Transformer, flops_per_token, hf, num_params
from tests.models.hf_parity import assert_counts_equal_transformers, assert_parity

# chunks of 8 and a temperature floor of 4 inside the 24-token parity sequences and the 30 of greedy decoding
SMALL = dict(hidden_size=64, intermediate_size=48, intermediate_size_mlp=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=64, num_local_experts=4,
             attention_chunk_size=8, floor_scale=4, attn_scale=0.5, rope_parameters={"rope_type": "default",
                                                                                     "rope_theta": 10000.0})


def test_published_sizes_equal_transformers_counts():
    assert_counts_equal_transformers("llama4")


def test_published_parameter_counts():
    # The model cards: Scout 109B and Maverick 400B in total with the vision encoder (the text models: 107.8B and
    # 400.7B), both 17B active.
    with torch.device("meta"):
        scout, maverick = Transformer(FLAVORS["Scout-17B-16E"]), Transformer(FLAVORS["Maverick-17B-128E"])
    assert round(num_params(scout) / 1e9, 1) == 107.8 and round(num_params(maverick) / 1e9, 1) == 400.7
    assert round(num_params(scout, active=True) / 1e9) == 17 and round(num_params(maverick, active=True) / 1e9) == 17


def test_layer_pattern_of_the_published_flavors():
    scout, maverick = FLAVORS["Scout-17B-16E"], FLAVORS["Maverick-17B-128E"]
    assert [i for i in range(48) if not scout.uses_rope(i)] == list(range(3, 48, 4))
    assert all(scout.is_moe_layer(i) for i in range(48))
    assert [i for i in range(48) if maverick.is_moe_layer(i)] == list(range(1, 48, 2))
    assert scout.layer_span(0).chunk == 8192 and scout.layer_span(3) is None


def test_flops_count_active_experts_shared_expert_and_chunks():
    args = FLAVORS["Maverick-17B-128E"]
    with torch.device("meta"):
        active = num_params(Transformer(args), active=True)
    # 36 chunked layers see at most 8192 keys (at 8192 every query's whole causal context), 12 NoPE layers all
    attention = 12 * args.n_heads * args.head_dim * 48 * 8192
    assert flops_per_token(args, 8192) == 6 * (active - args.vocab_size * args.dim) + attention
    chunked = 12 * args.n_heads * args.head_dim * 36 * (16384 - 2 * (8192 * 8193 // 2) * 2 / 16384)
    assert flops_per_token(args, 16384) == pytest.approx(6 * (active - args.vocab_size * args.dim)
                                                         + attention * 2 - chunked)


@pytest.mark.parametrize("variant", ["scout", "maverick"])
def test_matches_transformers(tmp_path: Path, variant: str):
    if variant == "scout":  # experts in every layer, q/k norms, Llama 3.1 RoPE scaling
        config = transformers.Llama4TextConfig(**{**SMALL, "rope_parameters": {
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}})
    else:  # dense and MoE layers alternate, no q/k norms
        config = transformers.Llama4TextConfig(**SMALL, interleave_moe_layer_step=2, use_qk_norm=False)
    ours = assert_parity(transformers.Llama4ForCausalLM, config, tmp_path, "llama4")
    assert ours.layers["3"].rope_table == "_nope" and ours.layers["3"].attention.span is None
    assert ours.layers["0"].attention.span.chunk == 8
    assert (ours.layers["0"].moe is None) == (variant == "maverick") and ours.layers["1"].moe is not None


def test_temperature_tuning_off_and_no_chunks_match_transformers(tmp_path: Path):
    config = transformers.Llama4TextConfig(**{**SMALL, "attention_chunk_size": None}, attn_temperature_tuning=False)
    ours = assert_parity(transformers.Llama4ForCausalLM, config, tmp_path, "llama4")
    assert ours.args.attention_chunk is None and not ours.args.temperature_tuning


def test_multimodal_checkpoint_loads_its_text_model(tmp_path: Path):
    """The hub's Scout/Maverick directories are Llama4ForConditionalGeneration: the text weights under
    language_model., a vision tower beside them, the text hyper-parameters in text_config."""
    text = transformers.Llama4TextConfig(**SMALL)
    torch.manual_seed(0)
    reference = transformers.Llama4ForCausalLM(text).eval()
    reference.save_pretrained(tmp_path / "text")
    weights = {f"language_model.{k}": v for k, v in load_file(tmp_path / "text" / "model.safetensors").items()}
    weights["vision_model.patch_embedding.linear.weight"] = torch.zeros(4, 4)
    weights["multi_modal_projector.linear_1.weight"] = torch.zeros(4, 4)
    (tmp_path / "mm").mkdir()
    save_file(weights, tmp_path / "mm" / "model.safetensors")
    text_dict = json.loads((tmp_path / "text" / "config.json").read_text())
    (tmp_path / "mm" / "config.json").write_text(json.dumps({
        "architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "text_config": text_dict,
        "vision_config": {"hidden_size": 4}}))
    ours = load_hf_model(tmp_path / "mm", "cpu", torch.float32).eval()
    tokens = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(ours(tokens), reference(tokens).logits, rtol=1e-4, atol=1e-4)


def test_layer_lists_ember_cannot_express_are_refused():
    config = transformers.Llama4TextConfig(**SMALL).to_dict()
    with pytest.raises(ValueError, match=r"moe_layers \[0, 3\] do not fall every n-th layer"):
        hf.args_from_hf_config({**config, "moe_layers": [0, 3]})
    with pytest.raises(ValueError, match="layers without RoPE"):
        hf.args_from_hf_config({**config, "no_rope_layers": [0, 1, 1, 1]})


def test_a_multimodal_config_without_text_config_is_refused(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Llama4ForConditionalGeneration"],
                                                      "model_type": "llama4"}))
    with pytest.raises(CheckpointError) as err:
        hf_family(tmp_path)
    assert str(err.value) == (f"'{tmp_path / 'config.json'}' describes a multimodal llama4 model without text_config, "
                              "where ember reads its text model's hyper-parameters; "
                              "restore text_config from the original")


@pytest.mark.parametrize("overrides, message", [
    ({"top_k": 0}, "model.top_k=0 must be >= 1 (a size or a count); set model.top_k to 1 or more, or drop model.top_k "
                   "(the flavor's is 1)"),
    ({"moe_hidden_dim": 0}, "model.moe_hidden_dim=0 must be >= 1 (a size or a count); set model.moe_hidden_dim to 1 or "
                            "more, or drop model.moe_hidden_dim (the flavor's is 256)"),
    ({"attention_chunk": 0}, "model.attention_chunk=0 must be >= 1 (a size or a count); set model.attention_chunk to 1 "
                             "or more, or drop model.attention_chunk (the flavor's is 64)"),
    ({"sparse_step": 9}, "model.sparse_step=9 leaves none of the 4 layers with experts "
                         "(layer i has them when (i + 1) % sparse_step == 0); use 1 to n_layers"),
    ({"top_k": 9}, "model.top_k=9 must be at most model.n_experts=8"),
])
def test_hyper_parameters_that_cannot_make_the_model_are_one_line(overrides: dict, message: str):
    from ember.errors import ConfigError
    from ember.models import build_model_args

    with pytest.raises(ConfigError) as info:
        build_model_args("llama4", "debug", overrides)
    assert str(info.value) == message
