"""GPT: Pax's sizes and exact parameter counts, logits equal to transformers' GPT2LMHeadModel, HF
import/export and convert, learned positions, and a short training run whose loss falls."""

import json
import math
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from ember import config as config_lib, load_model
from ember.model_io.convert import convert, save_hf
from ember.models import MODELS, build_model_args
from ember.models.gpt import FLAVORS, GPTArgs, Transformer, flops_per_token, hf, num_params, tp_plan
from ember.parallel.parallelize import ParallelOptions, parallelize
from ember.train import run as run_lib
from ember.train.trainer import Trainer

# (n_layers, dim, n_heads, ffn_hidden_dim, vocab_size, max_seq_len) of Pax's GPU configs
# (google/paxml paxml/contrib/gpu/scripts_gpu/configs.py: GPT126M, GPT5B, GPT175B).
PAX = {
    "126M": (12, 768, 12, 3072, 50304, 2048),
    "5B": (24, 4096, 32, 16384, 50304, 2048),
    "175B": (96, 12288, 96, 49152, 50257, 2048),
}
# Exact counts, tied embeddings counted once (what `ember recipes` shows).
PARAMS = {"debug": 5_780_992, "126M": 125_262_336, "5B": 5_047_558_144, "175B": 174_604_259_328}


def _meta_model(args: GPTArgs) -> Transformer:
    with torch.device("meta"):
        return Transformer(args)


def _debug_model(seed: int = 0, **overrides) -> Transformer:
    args = build_model_args("gpt", "debug", {"n_layers": 2, **overrides})
    torch.manual_seed(seed)
    model = _meta_model(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def _by_hand(layers: int, d: int, hidden: int, vocab: int, positions: int) -> int:
    # per layer: q, k, v, o (d x d + bias d each), MLP (d x hidden + hidden, hidden x d + d), 2 LayerNorms (2d each)
    layer = 4 * (d * d + d) + (d * hidden + hidden) + (hidden * d + d) + 2 * 2 * d
    return vocab * d + positions * d + layers * layer + 2 * d  # tied output adds nothing; final LayerNorm


@pytest.mark.parametrize("flavor", sorted(PARAMS))
def test_flavors_match_pax_and_count_exactly(flavor):
    args = FLAVORS[flavor]
    shape = (args.n_layers, args.dim, args.n_heads, args.ffn_hidden_dim, args.vocab_size, args.max_seq_len)
    if flavor in PAX:
        assert shape == PAX[flavor]
    assert args.tie_embeddings and args.kv_heads == args.n_heads and args.norm_eps == 1e-5
    layers, d, _, hidden, vocab, positions = shape
    assert num_params(_meta_model(args)) == _by_hand(layers, d, hidden, vocab, positions) == PARAMS[flavor]
    assert FLAVORS["175B"].head_dim == 128 and FLAVORS["5B"].head_dim == 128 and FLAVORS["126M"].head_dim == 64


def test_flops_per_token_is_palm_formula():
    # 6 N + 12 L H Q T, N = every parameter but the two lookups; the tied output matrix stays in N.
    for flavor in ("126M", "175B", "debug"):
        args = FLAVORS[flavor]
        n = num_params(_meta_model(args), exclude_embedding=True) + args.vocab_size * args.dim
        assert flops_per_token(args, 2048) == 6 * n + 12 * args.n_layers * args.n_heads * args.head_dim * 2048
    assert flops_per_token(FLAVORS["126M"], 2048) == 6 * (85_056_000 + 50304 * 768) + 12 * 12 * 768 * 2048


def test_registered_with_overrides_and_errors():
    assert MODELS["gpt"].model_cls is Transformer and MODELS["gpt"].hf is hf
    args = build_model_args("gpt", "126M", {"n_layers": 2, "max_seq_len": 4096})
    assert (args.n_layers, args.max_seq_len, args.dim) == (2, 4096, 768)
    with pytest.raises(ValueError, match="model.n_kv_heads is not a hyper-parameter of gpt"):
        build_model_args("gpt", "debug", {"n_kv_heads": 4})
    with pytest.raises(config_lib.ConfigError, match="ties its embedding to its output projection"):
        run_lib.load_config("debug", ["model.family=gpt", "ici_mesh.pipeline=2", "ici_mesh.fsdp=1"], world_size=2)


def test_init_is_gaussian_with_zero_biases_and_tied_output():
    model = _debug_model()
    assert model.output.weight is model.tok_embeddings.weight
    assert model.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.03)
    assert model.pos_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.03)
    block = model.layers["1"]
    assert block.attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.03)
    assert block.attention.wo.weight.std().item() == pytest.approx(0.02 / math.sqrt(4), rel=0.03)  # 2 x 2 layers
    assert torch.equal(block.attention.wq.bias, torch.zeros(256))
    assert torch.equal(block.ffn_norm.weight, torch.ones(256))
    assert torch.equal(model.norm.bias, torch.zeros(256))
    assert num_params(model, exclude_embedding=True) == num_params(model) - (8192 + 2048) * 256


def test_positions_index_the_learned_table_and_attention_is_causal():
    model = _debug_model(max_seq_len=32)
    tokens = torch.randint(0, 8192, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(tokens)
        assert torch.equal(model(tokens, torch.arange(20)), plain)
        # Shifted positions change the logits: the table is really read at `positions`.
        assert not torch.allclose(model(tokens, torch.arange(20) + 5), plain)
        # Two documents packed in one row, positions restarting at the second and attention kept inside
        # each (document masking): the second document's logits equal those of it alone.
        positions = torch.cat([torch.arange(8), torch.arange(12)]).expand(2, 20)
        document_ids = torch.cat([torch.zeros(8), torch.ones(12)]).long().expand(2, 20)
        packed = model(tokens, positions, document_ids)
        torch.testing.assert_close(packed[:, 8:], model(tokens[:, 8:]), rtol=1e-5, atol=1e-5)
        changed = tokens.clone()
        changed[:, 12:] = (changed[:, 12:] + 1) % 8192
        assert torch.equal(model(changed)[:, :12], plain[:, :12])
    with pytest.raises(ValueError, match="sequence length 33 exceeds max_seq_len=32"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_parallelize_on_one_device_keeps_parameter_names():
    model = _debug_model()
    names = [k for k, _ in model.named_parameters()]
    assert parallelize(model, None, tp_plan, ParallelOptions(remat="full", compile=True)) is model
    assert [k for k, _ in model.named_parameters()] == names
    assert "pos_embeddings.weight" in names and "output.weight" not in names  # tied: one Parameter


def _hf_model(directory: Path, tied: bool) -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_inner=160, vocab_size=160, n_positions=64,
                                     tie_word_embeddings=tied, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)  # weights of a visible size: HF's init leaves biases at zero and norms at one
    model.save_pretrained(directory)
    return model


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_logits_equal_transformers_export_and_convert(tmp_path: Path, tied: bool):
    reference = _hf_model(tmp_path / "hf", tied)
    tokens = torch.randint(0, 160, (2, 48), generator=torch.Generator().manual_seed(1))
    model = load_model(tmp_path / "hf")
    assert model.args == GPTArgs(dim=64, n_layers=2, n_heads=4, vocab_size=160, ffn_hidden_dim=160, max_seq_len=64,
                                 tie_embeddings=tied)
    assert (model.output.weight is model.tok_embeddings.weight) == tied
    with torch.no_grad():
        expected = reference(tokens).logits
        assert expected.abs().max() > 1.0  # not a near-zero comparison
        assert (model(tokens) - expected).abs().max().item() <= 1e-4
    # Export: transformers reads it back (Conv1D transposes, fused c_attn) with the same logits.
    save_hf(model, model.args, tmp_path / "export")
    with safe_open(str(tmp_path / "export" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert tuple(f.get_tensor("transformer.h.0.attn.c_attn.weight").shape) == (64, 192)
    assert ("lm_head.weight" in keys) == (not tied) and "transformer.wpe.weight" in keys
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("gpt2", ["GPT2LMHeadModel"])
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (reloaded(tokens).logits - expected).abs().max().item() <= 1e-4
    # convert: HF -> ember DCP -> HF, the same model each way
    assert convert(tmp_path / "hf", tmp_path / "ember") == "ember"
    assert json.loads((tmp_path / "ember" / "model.json").read_text())["family"] == "gpt"
    assert convert(tmp_path / "ember", tmp_path / "back") == "hf"
    with torch.no_grad():
        assert (load_model(tmp_path / "ember")(tokens) - expected).abs().max().item() <= 1e-4
        assert (load_model(tmp_path / "back")(tokens) - expected).abs().max().item() <= 1e-4


def test_hub_gpt2_key_names_and_unsupported_configs():
    # The hub's original gpt2 files: no "transformer." prefix, causal-mask buffers beside the weights.
    args = GPTArgs(dim=8, n_layers=1, n_heads=2, vocab_size=16, ffn_hidden_dim=32, max_seq_len=4)
    state = {k: torch.randn(v.shape) for k, v in _meta_model(args).state_dict().items()}
    state["output.weight"] = state["tok_embeddings.weight"]  # tied: state_dict lists the one matrix twice
    exported = hf.to_hf_state_dict(state, args)
    old_style = {k.removeprefix("transformer."): v for k, v in exported.items()}
    old_style["h.0.attn.bias"] = torch.ones(1, 1, 4, 4)
    old_style["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    back = hf.from_hf_state_dict(old_style, args)
    assert back.keys() == state.keys()
    for key in state:
        assert torch.equal(back[key], state[key]), key
    with pytest.raises(KeyError, match="not a weight of GPT2LMHeadModel"):
        hf.from_hf_state_dict({"transformer.h.0.crossattention.c_attn.weight": torch.zeros(1)}, args)
    config = hf.hf_config_from_args(args)
    assert hf.args_from_hf_config(config) == args
    with pytest.raises(ValueError, match="activation_function='relu' is not supported"):
        hf.args_from_hf_config({**config, "activation_function": "relu"})
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        hf.args_from_hf_config({**config, "scale_attn_by_inverse_layer_idx": True})
    with pytest.raises(ValueError, match="no n_embd, n_layer, n_head, vocab_size"):
        hf.args_from_hf_config({"model_type": "gpt2"})


@pytest.mark.slow
def test_debug_gpt_trains_and_its_loss_falls(tmp_path: Path):
    # 25 steps of 1k tokens of the embedded corpus from a near-uniform start (ln 8192 = 9.01); a narrower
    # debug GPT (dim 128) so that it takes seconds. Measured: 9.04 -> 6.76 (last-10 mean), val 6.75.
    cfg = run_lib.load_config("debug", ["model.family=gpt", "model.n_layers=2", "model.dim=128", "model.n_heads=4",
                                    "model.ffn_hidden_dim=512", "seq_len=128", "global_batch_size=8",
                                    "micro_batch_size=8", "max_steps=25", "logging_steps=5", "eval_batches=2",
                                    "optim.lr=3e-3", "schedule.warmup_steps=5", f"output_dir={tmp_path}",
                                    "metrics.console=false"])
    trainer = Trainer(cfg)
    assert trainer.num_params == _by_hand(2, 128, 512, 8192, 2048) == 1_707_520
    summary = trainer.train()
    assert summary["first_loss"] == pytest.approx(math.log(8192), abs=0.3)
    assert summary["final_loss_avg"] < summary["first_loss"] - 1.5
    assert summary["val_loss"] < summary["first_loss"] - 1.5
    assert load_model(tmp_path).args.dim == 128  # the checkpoint reloads as this GPT
