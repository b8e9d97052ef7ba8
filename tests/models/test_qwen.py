"""Qwen2/2.5, Qwen3 and Qwen3-MoE: published sizes, and parity with transformers' own classes (logits,
gradients, greedy generation, a bit-exact round trip) on small random configs."""

from pathlib import Path

import pytest
import torch
import transformers

from ember.models.qwen import FLAVORS, Transformer, flops_per_token, num_params
from tests.models.hf_parity import assert_counts_equal_transformers, assert_parity

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, max_position_embeddings=64, rope_theta=10000.0)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_moe"])
def test_published_sizes_equal_transformers_counts(family: str):
    assert_counts_equal_transformers(family)


def test_published_parameter_counts():
    # The model cards' totals (and Qwen3-MoE's active parameters), in billions.
    published = {("qwen2", "0.5B"): 0.49, ("qwen2", "1.5B"): 1.54, ("qwen2", "3B"): 3.09, ("qwen2", "7B"): 7.62,
                 ("qwen2", "14B"): 14.77, ("qwen2", "72B"): 72.71, ("qwen3", "0.6B"): 0.60, ("qwen3", "1.7B"): 1.72,
                 ("qwen3", "4B"): 4.02, ("qwen3", "8B"): 8.19, ("qwen3", "14B"): 14.77, ("qwen3", "32B"): 32.76,
                 ("qwen3_moe", "30B-A3B"): 30.53, ("qwen3_moe", "235B-A22B"): 235.09}
    for (family, flavor), billions in published.items():
        with torch.device("meta"):
            model = Transformer(FLAVORS[family][flavor])
        assert round(num_params(model) / 1e9, 2) == billions, (family, flavor)
    with torch.device("meta"):
        assert round(num_params(Transformer(FLAVORS["qwen3_moe"]["30B-A3B"]), active=True) / 1e9, 1) == 3.4
        assert round(num_params(Transformer(FLAVORS["qwen3_moe"]["235B-A22B"]), active=True) / 1e9, 1) == 22.2


def test_flops_count_active_experts_and_the_window():
    args = FLAVORS["qwen3_moe"]["30B-A3B"]
    with torch.device("meta"):
        active = num_params(Transformer(args), active=True)
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * 4096
    assert flops_per_token(args, 4096) == 6 * (active - args.vocab_size * args.dim) + attention
    dense = FLAVORS["qwen3"]["debug"]
    windowed = dense.__class__(**{**dense.__dict__, "sliding_window": 64, "max_window_layers": 2})
    # two of four layers see at most 64 keys: their attention term falls from 256 to 2 * mean keys seen
    seen = (64 * 65 / 2 + (256 - 64) * 64) * 2 / 256
    difference = 12 * dense.n_heads * dense.head_dim * 2 * (256 - seen)
    assert flops_per_token(dense, 256) - flops_per_token(windowed, 256) == pytest.approx(difference)


def test_qwen2_biases_and_tied_embeddings_match_transformers(tmp_path: Path):
    config = transformers.Qwen2Config(**SMALL, tie_word_embeddings=True)
    ours = assert_parity(transformers.Qwen2ForCausalLM, config, tmp_path, "qwen2")
    assert ours.layers["0"].attention.wq.bias is not None and ours.output.weight is ours.tok_embeddings.weight


def test_qwen3_qk_norm_and_wide_heads_match_transformers(tmp_path: Path):
    config = transformers.Qwen3Config(**SMALL, head_dim=32)  # 4 heads of 32 from a width of 64
    ours = assert_parity(transformers.Qwen3ForCausalLM, config, tmp_path, "qwen3")
    assert ours.layers["0"].attention.q_norm.weight.shape == (32,)


def test_qwen3_sliding_window_layers_match_transformers(tmp_path: Path):
    config = transformers.Qwen3Config(**SMALL, head_dim=16, use_sliding_window=True, sliding_window=5,
                                      max_window_layers=1)
    ours = assert_parity(transformers.Qwen3ForCausalLM, config, tmp_path, "qwen3")
    assert [ours.layers[str(i)].attention.span for i in range(3)] == [None, *[ours.args.layer_span(1)] * 2]
    # the window is doing something: without it the logits differ
    tokens = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        windowed = ours(tokens)
        for block in ours.layers.values():
            block.attention.span = None
        assert not torch.allclose(ours(tokens), windowed, atol=1e-3)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_matches_transformers(tmp_path: Path, norm_topk_prob: bool):
    config = transformers.Qwen3MoeConfig(**SMALL, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=norm_topk_prob)
    ours = assert_parity(transformers.Qwen3MoeForCausalLM, config, tmp_path, "qwen3_moe")
    assert [ours.layers[str(i)].moe is not None for i in range(3)] == [True, False, True]



@pytest.mark.parametrize("family, overrides, message", [
    ("qwen3", {"n_experts": 4}, r"^model.n_experts=4 does not fit model.family=qwen3: experts make qwen3_moe"),
    ("qwen3_moe", {"n_experts": 0}, r"^model.n_experts=0 does not fit model.family=qwen3_moe"),
    ("qwen3_moe", {"top_k": 32}, r"^model.top_k=32 must be at most model.n_experts=16$"),
    ("qwen3", {"sliding_window": 0}, r"^model.sliding_window=0 must be >= 1"),
    ("qwen3", {"max_window_layers": -1}, r"^model.max_window_layers=-1 must be >= 0 \(a size or a count\)"),
    ("qwen3", {"max_window_layers": 4, "sliding_window": 8},
     r"^model.max_window_layers=4 must be the first layer with the sliding window"),
    ("qwen3", {"max_window_layers": 1}, r"with model.sliding_window set$"),
    ("qwen3", {"moe_hidden_dim": 7}, r"^model.moe_hidden_dim is a Qwen3-MoE hyper-parameter, and qwen3 has no experts"),
    ("qwen3_moe", {"sparse_step": 0}, r"^model.sparse_step=0 must be >= 1 \(a size or a count\); set model.sparse_step "
                                      r"to 1 or more, or drop model.sparse_step \(the flavor's is 1\)$"),
    ("qwen3_moe", {"sparse_step": 5}, r"^model.sparse_step=5 leaves none of the 4 layers with experts "
                                      r"\(layer i has them when \(i \+ 1\) % sparse_step == 0\); use 1 to n_layers$"),
    ("qwen3_moe", {"top_k": 0}, r"^model.top_k=0 must be >= 1 \(a size or a count\); set model.top_k to 1 or more, or "
                                r"drop model.top_k \(the flavor's is 4\)$"),
    ("qwen3_moe", {"moe_hidden_dim": 0}, r"^model.moe_hidden_dim=0 must be >= 1 with model.n_experts=16 "
                                         r"\(each expert's SwiGLU hidden size\); "
                                         r"set model.moe_hidden_dim to 1 or more$"),
])
def test_hyper_parameters_that_do_not_fit_the_family_are_one_line(family, overrides, message):
    from ember.errors import ConfigError
    from ember.models import build_model_args

    with pytest.raises(ConfigError, match=message):
        build_model_args(family, "debug", overrides)


def test_a_refused_moe_width_writes_nothing_into_output_dir(tmp_path, capsys):
    # model.moe_hidden_dim=0 crashed in grouped_mm after config.yaml and run.json were written
    from ember.commands import run_command

    out = tmp_path / "run"
    assert run_command("train", ["debug", "model.family=qwen3_moe", "model.flavor=debug", "model.moe_hidden_dim=0",
                                 "max_steps=2", "seq_len=128", f"output_dir={out}"]) == 2
    assert capsys.readouterr().err == ("error: model.moe_hidden_dim=0 must be >= 1 with model.n_experts=16 (each "
                                       "expert's SwiGLU hidden size); set model.moe_hidden_dim to 1 or more\n")
    assert not out.exists()
