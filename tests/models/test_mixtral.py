"""Mixtral: published sizes, logits equal to transformers' MixtralForCausalLM, HF import/export, training."""

import copy
import json
from pathlib import Path

import pytest
import torch
import transformers

from ember import config as config_lib, load_model
from ember.model_io.convert import convert, save_hf
from ember.models import MODELS, build_model_args
from ember.models.mixtral import FLAVORS, Transformer, flops_per_token, num_params
from ember.nn.moe import MoE
from ember.nn.moe_stats import MoEOptions, MoEStats
from ember.train import run as run_lib
from ember.train.trainer import Trainer
from tests.helpers import read_records


def test_published_parameter_counts():
    with torch.device("meta"):
        m87 = Transformer(FLAVORS["8x7B"])
        m822 = Transformer(FLAVORS["8x22B"])
    assert num_params(m87) == 46_702_792_704
    assert num_params(m87, active=True) == 12_879_925_248  # "12.9B active"
    assert round(num_params(m822) / 1e9, 1) == 140.6 and round(num_params(m822, active=True) / 1e9) == 39
    # MFU counts active parameters: 6 x active non-embedding-lookup params + attention.
    args = FLAVORS["8x7B"]
    active_matmul = num_params(m87, active=True) - args.vocab_size * args.dim
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * 4096
    assert flops_per_token(args, 4096) == 6 * active_matmul + attention


def _hf_model(tmp_path: Path) -> tuple[transformers.MixtralForCausalLM, Path]:
    config = transformers.MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, vocab_size=128, max_position_embeddings=64,
                                        rope_theta=10000.0)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)  # random weights of a visible size (the init leaves some at zero)
    model.save_pretrained(tmp_path / "hf")
    return model, tmp_path / "hf"


def test_logits_equal_transformers_and_export_round_trips(tmp_path: Path):
    hf_model, hf_dir = _hf_model(tmp_path)
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    ours = load_model(hf_dir)
    with torch.no_grad():
        expected = hf_model(tokens).logits
        torch.testing.assert_close(ours(tokens), expected, rtol=1e-4, atol=1e-4)
    save_hf(ours, ours.args, tmp_path / "export")  # per-expert hub layout
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in json.dumps(
        list(__import__("safetensors").safe_open(str(tmp_path / "export" / "model.safetensors"), "pt").keys()))
    reloaded = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "export", torch_dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, expected, rtol=1e-4, atol=1e-4)
    assert convert(hf_dir, tmp_path / "ember") == "ember"
    with torch.no_grad():
        torch.testing.assert_close(load_model(tmp_path / "ember")(tokens), expected, rtol=1e-4, atol=1e-4)


def test_dropless_routing_matches_a_per_token_reference():
    torch.manual_seed(0)
    stats = MoEStats()
    moe = MoE(dim=16, hidden_dim=24, n_experts=4, top_k=2, options=MoEOptions(stats=stats))
    moe.init_weights(0.1)
    x = torch.randn(3, 5, 16)
    out = moe(x)
    flat = x.reshape(-1, 16)
    weights, indices, _ = moe.router(flat)
    expected = torch.zeros_like(flat)
    for t in range(flat.shape[0]):  # every token through each of its k experts, no capacity limit
        for w, e in zip(weights[t], indices[t]):
            h = torch.nn.functional.silu(flat[t] @ moe.experts.w1[e].t()) * (flat[t] @ moe.experts.w3[e].t())
            expected[t] += w * (h @ moe.experts.w2[e].t())
    torch.testing.assert_close(out.reshape(-1, 16), expected, rtol=1e-5, atol=1e-6)
    assert int(stats.of(moe).tokens_per_expert.sum()) == 15 * 2
    assert stats.of(moe).aux_loss >= 1.0 - 1e-6  # E * sum f_e P_e, minimal (1.0) when balanced


@pytest.mark.slow
def test_debug_mixtral_trains_with_router_losses_logged(tmp_path: Path):
    cfg = run_lib.load_config("debug", ["model.family=mixtral", "data.dataset=synthetic", "model.n_layers=2",
                                    "seq_len=64", "max_steps=30", "logging_steps=10", "optim.lr=3e-3",
                                    f"output_dir={tmp_path}", "metrics.console=false", "model.z_loss_coef=1e-3"])
    trainer = Trainer(cfg)
    summary = trainer.train()
    records = [r for r in read_records(tmp_path) if "loss" in r]
    assert {"aux_loss", "z_loss", "expert_imbalance"} <= records[-1].keys()
    # every training forward of every MoE layer counted: 10 steps x 8 x 64 tokens x top-2, per layer
    assert sum(records[-1]["moe/layer1/tokens_per_expert"]) == 10 * 8 * 64 * 2
    copy.deepcopy(trainer.model)  # the trainer's MoE hooks hold it weakly: the model still copies (EMA, export)
    assert records[-1]["expert_imbalance"] >= 1.0
    assert summary["final_loss_avg"] < summary["first_loss"]  # random tokens: it learns the unigram floor
    run_lib.load_config("debug", ["model.family=mixtral", "ici_mesh.tensor=2", "ici_mesh.fsdp=1"], world_size=2)
    with pytest.raises(config_lib.ConfigError, match="expert-parallel degree 3 does not divide model.n_experts=8"):
        run_lib.load_config("debug", ["model.family=mixtral", "ici_mesh.expert=3", "ici_mesh.fsdp=1",
                                      "global_batch_size=24", "micro_batch_size=8"], world_size=3)
    assert build_model_args("mixtral", "debug", {"n_experts": 4}).n_experts == 4
    assert "mixtral" in MODELS
