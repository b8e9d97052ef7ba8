"""Llama: published parameter counts, logits equal to transformers', checkpoint round trips."""

import ast
import json
from pathlib import Path

import pytest
import torch

from ember.load import load_model, save_ember_checkpoint
from ember.models import MODELS, build_model_args
from ember.models.llama import hf
from ember.models.llama.args import LlamaArgs

PUBLISHED = {
    ("llama2", "7B"): 6_738_415_616,
    ("llama2", "13B"): 13_015_864_320,
    ("llama2", "70B"): 68_976_648_192,
    ("llama3", "8B"): 8_030_261_248,
    ("llama3", "70B"): 70_553_706_496,
    ("llama3.1", "8B"): 8_030_261_248,
    ("llama3.1", "70B"): 70_553_706_496,
    ("llama3.1", "405B"): 405_853_388_800,
    ("llama3.2", "1B"): 1_235_814_400,
    ("llama3.2", "3B"): 3_212_749_824,
}


@pytest.mark.parametrize("family, flavor", sorted(PUBLISHED))
def test_parameter_counts_equal_published(family, flavor):
    args = build_model_args(family, flavor)
    with torch.device("meta"):
        model = MODELS[family].model_cls(args)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[(family, flavor)]


def test_model_files_do_not_import_torch_distributed():
    root = Path(__file__).parents[2] / "ember" / "models"
    files = sorted(root.glob("*/model.py"))
    assert files
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.startswith("torch.distributed") for n in names), f"{path} imports torch.distributed"


def test_meta_build_then_init_is_finite_and_deterministic():
    args = build_model_args("llama3", "debug", {"n_layers": 2})
    outs = []
    for _ in range(2):
        torch.manual_seed(0)
        with torch.device("meta"):
            model = MODELS["llama3"].model_cls(args)
        model.to_empty(device="cpu")
        model.init_weights()
        outs.append(model(torch.arange(16).view(1, 16)))
    assert outs[0].shape == (1, 16, args.vocab_size) and torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1])


def _hf_model(tmp_path: Path, rope_scaling: bool, tied: bool, shard: bool):
    transformers = pytest.importorskip("transformers")
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if rope_scaling:  # sequences below are longer than the original window, so the scaling matters
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=320, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=tied,
        rope_parameters=rope,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # HF initialises norms to ones; random ones make the test see a swapped norm
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path, max_shard_size="100KB" if shard else "5GB")
    return model


@pytest.mark.parametrize("rope_scaling, tied, shard", [(False, False, False), (True, False, True), (True, True, False)])
def test_logits_equal_transformers(tmp_path: Path, rope_scaling, tied, shard):
    reference = _hf_model(tmp_path, rope_scaling, tied, shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    model = load_model(tmp_path)
    tokens = torch.randint(0, 320, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(tokens).logits
        got = model(tokens)
    assert got.shape == expected.shape == (2, 48, 320)
    assert (got - expected).abs().max().item() <= 1e-4
    assert not model.training


def test_hf_state_dict_round_trip():
    args = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=16, max_seq_len=64)
    torch.manual_seed(0)
    model = MODELS["llama3"].model_cls(args)
    model.init_weights()
    sd = model.state_dict()
    back = hf.from_hf_state_dict(hf.to_hf_state_dict(sd, args), args)
    assert sd.keys() == back.keys() and all(torch.equal(sd[k], back[k]) for k in sd)
    assert hf.args_from_hf_config(hf.hf_config_from_args(args)) == args or \
        hf.args_from_hf_config(hf.hf_config_from_args(args)).ffn_hidden_dim == args.ffn_hidden_dim


def test_ember_checkpoint_round_trip(tmp_path: Path):
    args = build_model_args("llama3.2", "debug", {"n_layers": 2})
    torch.manual_seed(0)
    model = MODELS["llama3.2"].model_cls(args)
    model.init_weights()
    save_ember_checkpoint(model, "llama3.2", "debug", args, tmp_path / "run" / "checkpoints" / "step-3")
    tokens = torch.randint(0, args.vocab_size, (1, 12))
    loaded = load_model(tmp_path / "run")
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))
    assert loaded.output.weight is loaded.tok_embeddings.weight  # still tied after loading


def test_load_errors(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        load_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="neither an ember checkpoint"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf.hf_config_from_args(build_model_args("llama3", "debug"))))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(tmp_path)
