"""DeepSeek-V3 and DeepSeek-V2(-Lite): published sizes, and parity with transformers' own classes (logits, gradients,
greedy generation through the latent cache, a bit-exact round trip) on small random configs."""

from pathlib import Path

import pytest
import torch
import transformers

from ember.models import MODELS, build_model_args
from ember.models.deepseek import FLAVORS, Transformer, flops_per_token, hf, num_params
from ember.nn.mla import LatentKVCache
from tests.models.hf_parity import assert_counts_equal_transformers, assert_parity

YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=16, beta_fast=32,
            beta_slow=1, mscale=0.707, mscale_all_dim=0.707)
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
             vocab_size=128, max_position_embeddings=128, kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8,
             v_head_dim=10, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
             first_k_dense_replace=1)


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_published_sizes_equal_transformers_counts(family: str):
    assert_counts_equal_transformers(family)


def test_published_parameter_counts():
    # DeepSeek-V3: 671B total, 37B activated per token; V2-Lite: 15.7B total, 2.4B activated. The activated counts
    # leave out the embedding table (a lookup): 36.63B (the V3 report's "37B", rounded) and 2.45B (the V2 paper's
    # "2.4B", cut to one decimal).
    for family, flavor, total, active in (("deepseek_v3", "671B", 671.03, 36.63), ("deepseek_v2", "16B", 15.71, 2.45)):
        args = FLAVORS[family][flavor]
        with torch.device("meta"):
            model = Transformer(args)
        assert round(num_params(model) / 1e9, 2) == total, flavor
        assert round((num_params(model, active=True) - args.vocab_size * args.dim) / 1e9, 2) == active, flavor


def test_flops_count_active_experts_and_mla_widths():
    args = FLAVORS["deepseek_v3"]["671B"]
    with torch.device("meta"):
        active = num_params(Transformer(args), active=True)
    # scores over 192-wide q/k heads and outputs over 128-wide v heads: 6 L H T (192 + 128)
    attention = 6 * args.n_layers * args.n_heads * (192 + 128) * 4096
    assert flops_per_token(args, 4096) == 6 * (active - args.vocab_size * args.dim) + attention


def test_v3_latent_q_groups_shared_expert_dense_layer_and_yarn_match_transformers(tmp_path: Path):
    config = transformers.DeepseekV3Config(**SMALL, q_lora_rank=16, n_group=4, topk_group=2, n_shared_experts=1,
                                           routed_scaling_factor=2.5, norm_topk_prob=True,
                                           rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0})
    ours = assert_parity(transformers.DeepseekV3ForCausalLM, config, tmp_path, "deepseek_v3")
    assert [ours.layers[str(i)].moe is not None for i in range(3)] == [False, True, True]
    assert ours.layers["1"].moe.router.score_bias is not None and ours.args.yarn_factor == 8.0


def test_v3_score_bias_changes_the_routing_and_is_read(tmp_path: Path):
    config = transformers.DeepseekV3Config(**SMALL, q_lora_rank=16, n_group=2, topk_group=1, n_shared_experts=1,
                                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    from tests.models.hf_parity import assert_logits_and_gradients_equal, random_hf_model
    hf_model = random_hf_model(transformers.DeepseekV3ForCausalLM, config, tmp_path / "hf")
    with torch.no_grad():  # a bias large enough to move experts in and out of the top k
        for layer in hf_model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.5)
    hf_model.save_pretrained(tmp_path / "hf")
    ours = assert_logits_and_gradients_equal(hf_model, tmp_path / "hf", "deepseek_v3")
    torch.testing.assert_close(ours.layers["2"].moe.router.score_bias,
                               hf_model.model.layers[2].mlp.gate.e_score_correction_bias, rtol=0, atol=0)


def test_v3_rope_interleave_false_permutes_the_rope_rows(tmp_path: Path):
    config = transformers.DeepseekV3Config(**SMALL, q_lora_rank=None, n_group=1, topk_group=1, n_shared_experts=2,
                                           rope_interleave=False, rope_parameters=YARN)
    ours = assert_parity(transformers.DeepseekV3ForCausalLM, config, tmp_path, "deepseek_v3")
    assert ours.args.rope_interleave is False and ours.layers["0"].attention.wq is not None


@pytest.mark.parametrize("topk_method", ["greedy", "group_limited_greedy"])
def test_v2_lite_plain_q_and_softmax_routing_match_transformers(tmp_path: Path, topk_method: str):
    config = transformers.DeepseekV2Config(**SMALL, q_lora_rank=None, n_shared_experts=2, topk_method=topk_method,
                                           n_group=4 if topk_method != "greedy" else None,
                                           topk_group=2 if topk_method != "greedy" else None,
                                           norm_topk_prob=True, rope_parameters=YARN)  # V2 ignores norm_topk_prob
    ours = assert_parity(transformers.DeepseekV2ForCausalLM, config, tmp_path, "deepseek_v2")
    assert ours.layers["0"].attention.wq is not None and ours.args.score_func == "softmax"
    assert not ours.args.norm_topk_prob and ours.layers["1"].moe.router.score_bias is None


def test_generation_caches_the_latent_only():
    from ember.generate import attach_kv_caches, detach_kv_caches

    args = build_model_args("deepseek_v3", "debug")
    model = Transformer(args)
    caches = attach_kv_caches(model, batch=2, max_len=40)
    assert len(caches) == args.n_layers and all(isinstance(c, LatentKVCache) for c in caches)
    assert ({(c.c_kv.shape, c.k_rope.shape) for c in caches}
            == {((2, 40, args.kv_lora_rank), (2, 40, args.qk_rope_head_dim))})
    detach_kv_caches(model)
    assert all(m.attention.kv_cache is None for m in model.layers.values())


@pytest.mark.parametrize("config, message", [
    (dict(model_type="deepseek_v3", num_key_value_heads=2), r"num_key_value_heads=2 differs"),
    (dict(model_type="deepseek_v2", topk_method="noaux_tc"), r"topk_method 'noaux_tc' is not one"),
    (dict(model_type="deepseek_v3", attention_bias=True), r"attention_bias/mlp_bias=true are not supported"),
    (dict(model_type="deepseek_v3", rope_parameters={"rope_type": "llama3", "rope_theta": 1.0}), r"RoPE type 'llama3'"),
])
def test_configs_ember_cannot_express_are_refused(config: dict, message: str):
    base = hf.hf_config_from_args(FLAVORS["deepseek_v3"]["debug"])
    with pytest.raises(ValueError, match=message):
        hf.args_from_hf_config({**base, **config})


def test_families_are_registered_and_round_trip_their_config():
    for family, flavor in (("deepseek_v3", "671B"), ("deepseek_v2", "16B")):
        args = FLAVORS[family][flavor]
        assert MODELS[family].hf.family_of(args) == family
        assert hf.args_from_hf_config(hf.hf_config_from_args(args)) == args


def test_experts_that_do_not_fit_the_router_groups_are_one_line():
    from ember.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^model.n_groups=4 does not split model.n_experts=4 into groups of 2 "
                                          r"or more experts; use model.n_groups=2, or model.n_experts a multiple of 4 "
                                          r"of at least 8$"):
        build_model_args("deepseek_v3", "debug", {"n_experts": 4})
    build_model_args("deepseek_v3", "debug", {"n_experts": 12})  # a multiple of 4, at least 8: what the error asks
    assert build_model_args("deepseek_v3", "debug", {"n_experts": 8, "top_k": 2}).n_experts == 8
    assert build_model_args("deepseek_v3", "debug", {"n_experts": 4, "n_groups": 2}).n_groups == 2  # the other fix


# Each was a traceback from deep inside the model (ZeroDivisionError, the router's ValueError, a negative dimension),
# a run whose every step was skipped, or a model trained silently without what its name says.
REFUSED = [
    ({"top_k": 0}, "model.top_k=0 must be >= 1 (a size or a count); set model.top_k to 1 or more, or drop model.top_k "
                   "(the flavor's is 4)"),
    ({"n_groups": 0}, "model.n_groups=0 must be >= 1 (a size or a count); set model.n_groups to 1 or more, or drop "
                      "model.n_groups (the flavor's is 4)"),
    ({"n_shared_experts": -1}, "model.n_shared_experts=-1 must be >= 0 (a size or a count); set model.n_shared_experts "
                               "to 0 or more, or drop model.n_shared_experts (the flavor's is 1)"),
    ({"kv_lora_rank": 0}, "model.kv_lora_rank=0 must be >= 1 (a size or a count); set model.kv_lora_rank to 1 or more, "
                          "or drop model.kv_lora_rank (the flavor's is 64)"),
    ({"q_lora_rank": -8}, "model.q_lora_rank=-8 must be >= 1 (a size or a count); set model.q_lora_rank to 1 or more, "
                          "or drop model.q_lora_rank (the flavor's is 96)"),
    ({"topk_groups": 5}, "model.topk_groups=5 must be at most model.n_groups=4 (the groups experts are chosen from); "
                         "lower model.topk_groups or raise model.n_groups"),
    ({"n_groups": 3}, "model.n_groups=3 does not split model.n_experts=16 into groups of 2 or more experts; use "
                      "model.n_groups=2, 4 or 8, or model.n_experts a multiple of 3 of at least 6"),
    ({"n_groups": 8, "top_k": 6}, "model.top_k=6 exceeds the 4 experts of the model.topk_groups=2 chosen groups "
                                  "(2 each); use model.top_k <= 4 or raise model.topk_groups (up to model.n_groups=8)"),
    ({"n_dense_layers": 10}, "model.n_dense_layers=10 leaves none of the 4 layers with experts (layers from "
                             "n_dense_layers on have them); use 0 to 3, or raise model.n_layers"),
    ({"qk_rope_head_dim": 3}, "model.qk_rope_head_dim=3 must be even (RoPE turns pairs of it); use 2 or 4"),
]


@pytest.mark.parametrize("overrides, message", REFUSED)
def test_hyper_parameters_that_cannot_make_the_model_are_one_line_naming_the_key(overrides: dict, message: str):
    from ember.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        build_model_args("deepseek_v3", "debug", overrides)
    assert str(info.value) == message


def test_counts_that_may_be_none_and_heads_mla_sizes_itself_are_accepted():
    # no shared expert, no dense layer; MLA's heads are not dim / n_heads (7 heads of a 256 width)
    args = build_model_args("deepseek_v3", "debug", {"n_shared_experts": 0, "n_dense_layers": 0, "n_heads": 7})
    model = Transformer(args)
    assert model.layers["0"].moe.shared_expert is None and model.layers["0"].attention.n_heads == 7
    assert model(torch.randint(0, 100, (1, 8))).shape == (1, 8, args.vocab_size)


def test_the_loader_and_a_runs_config_hold_the_same_rules(tmp_path: Path):
    # top_k=0 used to be trained (every step skipped: grad norm nan) into a checkpoint the loader then refused
    import dataclasses

    from ember.errors import CheckpointError
    from ember.model_io.model_meta import meta_for, parse_model_meta

    args = FLAVORS["deepseek_v3"]["debug"]
    assert parse_model_meta(meta_for("deepseek_v3", "debug", dataclasses.replace(args, n_dense_layers=0)), "m")[2] \
        == build_model_args("deepseek_v3", "debug", {"n_dense_layers": 0})
    with pytest.raises(CheckpointError, match=r"^'m': deepseek_v3 hyper-parameter 'top_k' = 0 must be >= 1$"):
        parse_model_meta(meta_for("deepseek_v3", "debug", dataclasses.replace(args, top_k=0)), "m")
    with pytest.raises(CheckpointError, match=r"^'m': the deepseek_v3 hyper-parameters do not fit together \(model."
                                              r"n_groups=3 does not split model.n_experts=16"):
        parse_model_meta(meta_for("deepseek_v3", "debug", dataclasses.replace(args, n_groups=3)), "m")


# config.json of deepseek-ai/DeepSeek-V3 and deepseek-ai/DeepSeek-V2-Lite on the hub (auto_map and token ids left out)
HUB_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
          "aux_loss_alpha": 0.001, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
          "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
          "model_type": "deepseek_v3",
          "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
          "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
          "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
          "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
          "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                           "original_max_position_embeddings": 4096, "type": "yarn"},
          "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
          "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "v_head_dim": 128,
          "vocab_size": 129280}
HUB_V2_LITE = {"architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "aux_loss_alpha": 0.001,
               "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 10944,
               "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2",
               "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64,
               "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6,
               "num_hidden_layers": 27, "num_key_value_heads": 16, "q_lora_rank": None, "qk_nope_head_dim": 128,
               "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
               "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                                "original_max_position_embeddings": 4096, "type": "yarn"},
               "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
               "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "v_head_dim": 128,
               "vocab_size": 102400}


def test_the_hubs_configs_are_the_flavors_and_fp8_is_refused():
    assert hf.args_from_hf_config(HUB_V3) == FLAVORS["deepseek_v3"]["671B"]
    assert hf.args_from_hf_config(HUB_V2_LITE) == FLAVORS["deepseek_v2"]["16B"]
    fp8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(ValueError, match=r"^quantization_config \(fp8\) is not supported: .*fp8_cast_bf16.py\)$"):
        hf.args_from_hf_config({**HUB_V3, "quantization_config": fp8})


def test_multi_token_prediction_layers_are_skipped_on_import():
    args = FLAVORS["deepseek_v3"]["debug"]
    state = Transformer(args).state_dict()
    hub = {**hf.to_hf_state_dict(state, args), "model.layers.4.eh_proj.weight": torch.zeros(2, 2),
           "model.layers.4.mlp.experts.0.gate_proj.weight": torch.zeros(2, 2)}  # the hub's layer 61, here 4
    assert hf.from_hf_state_dict(hub, args).keys() == state.keys()
    assert (hf.skip_hf_key("model.layers.4.enorm.weight", args)
            and not hf.skip_hf_key("model.layers.3.enorm.weight", args))


def test_state_dict_keys_are_unchanged():
    # checkpoints, the TP plan and LoRA's targets name these; V2's plain wq stands where V3 has wq_a, q_norm, wq_b
    attention = ["kv_norm.weight", "wkv_a.weight", "wkv_b.weight", "wo.weight"]
    for family, q in (("deepseek_v3", ["q_norm.weight", "wq_a.weight", "wq_b.weight"]), ("deepseek_v2", ["wq.weight"])):
        with torch.device("meta"):
            model = Transformer(build_model_args(family, "debug"))
        layer0 = [f"attention.{k}" for k in sorted(attention + q)] + [
            "attention_norm.weight", "feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight",
            "ffn_norm.weight"]
        moe = ["moe.experts.w1", "moe.experts.w2", "moe.experts.w3", "moe.router.gate.weight",
               *(["moe.router.score_bias"] if family == "deepseek_v3" else []),
               "moe.shared_expert.w1.weight", "moe.shared_expert.w2.weight", "moe.shared_expert.w3.weight"]
        layer1 = sorted(set(layer0) - {k for k in layer0 if k.startswith("feed_forward")} | set(moe))
        keys = {k for k in model.state_dict() if not k.startswith("layers.") or k.split(".")[1] in ("0", "1")}
        assert sorted(keys) == sorted([f"layers.0.{k}" for k in layer0] + [f"layers.1.{k}" for k in layer1]
                                      + ["norm.weight", "output.weight", "tok_embeddings.weight"]), family
