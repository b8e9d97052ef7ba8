"""Hugging Face parity: a LlamaForCausalLM saved by transformers loads into ember with equal logits."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers  # the test extra installs it: parity is never skipped
from safetensors.torch import load_file

from ember.model_io.convert import save_hf
from ember.model_io.load import load_model
from ember.models import build_model_args
from ember.models.llama import FLAVORS, LlamaArgs, hf
from ember.models.mixtral import hf as mixtral_hf

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
SEQ = 100  # longer than the original 64-token window, so the llama3 scaling changes the logits


def _save_hf_model(directory: Path, *, kv_heads: int = 2, rope: dict | None = None, tied: bool = False,
                   shard: bool = False, head_dim: int | None = None):
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, vocab_size=320, max_position_embeddings=256, rms_norm_eps=1e-5,
        tie_word_embeddings=tied, rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0},
        head_dim=head_dim,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # HF sets norms to ones, where a swapped or missing norm would go unseen
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(directory, max_shard_size="60KB" if shard else "5GB")
    return model


CASES = {
    "mha-default-rope": dict(kv_heads=4),
    "gqa-llama3-rope-sharded": dict(rope=LLAMA3_ROPE, shard=True),
    "gqa-llama3-rope-tied": dict(rope=LLAMA3_ROPE, tied=True),
    # heads wider than hidden_size / heads (MaxText's fixed 128; Qwen3's): q/k/v project to 4 x 32 = 128
    "gqa-wide-heads": dict(head_dim=32),
}


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_transformers(tmp_path: Path, case):
    reference = _save_hf_model(tmp_path, **CASES[case])
    assert (tmp_path / "model.safetensors.index.json").is_file() == CASES[case].get("shard", False)
    model = load_model(tmp_path)
    assert not model.training
    tokens = torch.randint(0, 320, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(tokens).logits
        got = model(tokens)
    assert got.shape == expected.shape == (2, SEQ, 320)
    assert (got - expected).abs().max().item() <= 1e-4
    if CASES[case].get("tied"):
        assert model.output.weight is model.tok_embeddings.weight


def test_llama3_rope_scaling_is_what_makes_the_logits_match(tmp_path: Path):
    reference = _save_hf_model(tmp_path, rope=LLAMA3_ROPE)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tokens = torch.randint(0, 320, (1, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (load_model(tmp_path)(tokens) - reference(tokens).logits).abs()
    assert diff[:, 0].max() < 1e-5  # the first token attends only to itself, where RoPE cancels out...
    assert diff.max() > 1e-3  # ...later ones see the scaled frequencies


def test_bf16_load_is_close(tmp_path: Path):
    reference = _save_hf_model(tmp_path, rope=LLAMA3_ROPE)
    model = load_model(tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and model.rope_cos.dtype == torch.float32
    tokens = torch.randint(0, 320, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, expected = model(tokens).float(), reference(tokens).logits
    assert (got - expected).abs().max().item() < 0.1 * expected.abs().max().item()


def test_state_dict_round_trips(tmp_path: Path):
    _save_hf_model(tmp_path, rope=LLAMA3_ROPE)
    args = hf.args_from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    hf_sd = load_file(str(tmp_path / "model.safetensors"))
    ember_sd = hf.from_hf_state_dict(hf_sd, args)
    back = hf.to_hf_state_dict(ember_sd, args)
    assert back.keys() == hf_sd.keys() and all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)
    # the permutation is not the identity, and each of q (4 heads) and k (2 heads) is undone exactly
    q = "layers.0.attention.wq.weight"
    assert not torch.equal(ember_sd[q], hf_sd["model.layers.0.self_attn.q_proj.weight"])
    w = torch.arange(8 * 3).view(8, 3)  # one head of size 8: pair rows (0,1) (2,3)... -> halves (0,2,4,6)(1,3,5,7)
    assert hf.permute_to_hf(w, 1)[:, 0].tolist() == [0, 6, 12, 18, 3, 9, 15, 21]
    assert torch.equal(hf.permute_from_hf(hf.permute_to_hf(w, 2), 2), w)


def test_tied_state_dict_round_trip(tmp_path: Path):
    model = _save_hf_model(tmp_path, tied=True)
    args = hf.args_from_hf_config(model.config.to_dict())
    in_memory = model.state_dict()  # holds lm_head.weight too; save_pretrained drops it
    ember_sd = hf.from_hf_state_dict(in_memory, args)
    assert ember_sd["output.weight"] is ember_sd["tok_embeddings.weight"]
    assert hf.to_hf_state_dict(ember_sd, args).keys() == load_file(str(tmp_path / "model.safetensors")).keys()


def test_unknown_hf_weight_is_an_error():
    args = FLAVORS["llama3"]["debug"]
    with pytest.raises(KeyError, match="'model.layers.0.self_attn.q_norm.weight' is not a weight of LlamaForCausalLM"):
        hf.from_hf_state_dict({"model.layers.0.self_attn.q_norm.weight": torch.zeros(1)}, args)


def _same_ffn_as(args: LlamaArgs, other: LlamaArgs) -> LlamaArgs:
    """args with the FFN size expressed as in other (HF states it outright, Meta by formula)."""
    return dataclasses.replace(args, multiple_of=other.multiple_of, ffn_dim_multiplier=other.ffn_dim_multiplier,
                               ffn_hidden_dim_override=other.ffn_hidden_dim_override)


@pytest.mark.parametrize("family, flavor", [(f, v) for f in FLAVORS for v in FLAVORS[f]])
def test_config_round_trip(family, flavor):
    args = build_model_args(family, flavor)
    config = hf.hf_config_from_args(args)
    back = hf.args_from_hf_config(config)
    # HF states intermediate_size and num_key_value_heads outright; all else comes back equal
    assert (back.ffn_hidden_dim, back.kv_heads) == (args.ffn_hidden_dim, args.kv_heads)
    assert dataclasses.replace(_same_ffn_as(back, args), n_kv_heads=args.n_kv_heads) == args
    hf_config = transformers.LlamaConfig(**config)  # transformers accepts what we write
    assert hf_config.intermediate_size == args.ffn_hidden_dim
    assert hf_config.rope_parameters["rope_theta"] == args.rope_theta


def test_llama31_8b_config_matches_the_release():
    # meta-llama/Llama-3.1-8B config.json (transformers 4.x format), the fields ember reads
    release = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 128256, "rms_norm_eps": 1e-05, "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
    }
    args = hf.args_from_hf_config(release)
    assert args.ffn_hidden_dim == 14336 and _same_ffn_as(args, FLAVORS["llama3.1"]["8B"]) == FLAVORS["llama3.1"]["8B"]
    ours = hf.hf_config_from_args(FLAVORS["llama3.1"]["8B"])
    assert {k: ours[k] for k in release} == release


def test_wide_heads_export_loads_in_transformers_and_round_trips(tmp_path: Path):
    reference = _save_hf_model(tmp_path / "hf", head_dim=32)
    model = load_model(tmp_path / "hf")
    assert (model.args.head_dim, model.layers["0"].attention.wq.weight.shape) == (32, (128, 64))
    save_hf(model, model.args, tmp_path / "export")
    assert json.loads((tmp_path / "export" / "config.json").read_text())["head_dim"] == 32
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "export", torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, reference(tokens).logits, rtol=0, atol=0)
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert exported.keys() == original.keys() and all(torch.equal(exported[k], original[k]) for k in original)


def test_head_dim_is_a_model_key_and_its_mistakes_are_named():
    args = build_model_args("llama2", "7B", {"dim": 4096, "n_heads": 64, "head_dim": 128})
    assert (args.head_dim, args.head_dim_override, build_model_args("llama2", "7B").head_dim) == (128, 128, 128)
    assert build_model_args("llama2", "7B", {"dim": 4096, "n_heads": 64}).head_dim == 64
    # dim / n_heads stated outright is the same model as left unset (a resume compares the two)
    assert build_model_args("llama2", "7B", {"head_dim": 128}) == build_model_args("llama2", "7B")
    with pytest.raises(ValueError, match=r"^model.head_dim=33 must be a positive even number"):
        build_model_args("llama2", "7B", {"head_dim": 33})
    with pytest.raises(ValueError, match=r"model.dim=4096 must split into model.n_heads=48 heads of even size "
                                         r"\(or set model.head_dim\)"):
        build_model_args("llama2", "7B", {"n_heads": 48})
    assert build_model_args("llama2", "7B", {"n_heads": 48, "head_dim": 64}).head_dim == 64
    mixtral = mixtral_hf.hf_config_from_args(build_model_args("mixtral", "debug"))
    assert mixtral_hf.args_from_hf_config({**mixtral, "head_dim": 64}).head_dim == 64  # Mistral-Nemo's kind
    assert mixtral_hf.args_from_hf_config(mixtral).head_dim_override is None
    with pytest.raises(ValueError, match="model.head_dim is not a hyper-parameter of gpt"):
        build_model_args("gpt", "126M", {"head_dim": 64})


def test_unsupported_hf_configs_are_refused():
    base = hf.hf_config_from_args(FLAVORS["llama3"]["debug"])
    with pytest.raises(ValueError, match="RoPE type 'yarn' is not supported"):
        hf.args_from_hf_config({**base, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}})
    with pytest.raises(ValueError, match="attention_bias=true is not supported"):
        hf.args_from_hf_config({**base, "attention_bias": True})
    assert hf.args_from_hf_config({**base, "head_dim": 64}).head_dim == 64  # wider heads: taken as stated
