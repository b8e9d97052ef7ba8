"""LoRA on the families added on the shared decoder (Qwen2's biased projections, Qwen3's q/k norms and wide
heads, Qwen3-MoE's attention, Mistral's sliding window, Llama 4's dense and shared-expert SwiGLUs, DeepSeek-V3's
MLA projections): trained by ember, exported as a peft adapter that peft applies to transformers' own model with
ember's logits, and folded back by ember."""

import json
import warnings
from pathlib import Path

import pytest
import safetensors.torch
import torch

from ember.errors import CheckpointError
from ember.finetune.peft_format import PREFIX
from ember.model_io.convert import convert
from ember.model_io.load import load_model
from ember.train import run as run_lib
from ember.train.trainer import Trainer

SMALL = ["model.n_layers=2", "model.dim=64", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=512",
         "data.dataset=synthetic", "seq_len=32", "global_batch_size=8", "micro_batch_size=8", "logging_steps=1",
         "eval_batches=1", "metrics.console=false", "metrics.tensorboard=false", "optim.lr=1e-2"]
FAMILIES = {
    "qwen2": ["model.ffn_hidden_dim=96"],
    "qwen3": ["model.ffn_hidden_dim=96"],  # the debug flavor's 64-wide heads: 4 x 64 from a width of 64
    # layer 0 dense ((0 + 1) % sparse_step != 0), layer 1 with experts
    "qwen3_moe": ["model.ffn_hidden_dim=96", "model.moe_hidden_dim=32", "model.n_experts=4", "model.top_k=2",
                  "model.sparse_step=2"],
    "mistral": ["model.ffn_hidden_dim=96", "model.sliding_window=8"],
    "gemma3": ["model.ffn_hidden_dim=96", "model.sliding_window=8"],  # 2 local layers (global every 6th)
    # layer 0 dense with chunked RoPE, layer 1 NoPE with experts and the shared expert
    "llama4": ["model.ffn_hidden_dim=96", "model.moe_hidden_dim=32", "model.n_experts=4", "model.nope_every=2",
               "model.attention_chunk=8", "model.floor_scale=4"],
    # MLA's five projections (q through its latent); layer 0 dense, layer 1 with 8 grouped experts and the shared one;
    # score biases frozen, as a peft adapter cannot carry moved ones (test_lora_moe.py: refused)
    "deepseek_v3": ["model.n_kv_heads=null", "model.ffn_hidden_dim=96", "model.moe_hidden_dim=32", "model.n_experts=8",
                    "model.top_k=2", "model.bias_update_rate=0"],
}
# experts are stacked weights, not nn.Linear: LoRA adapts attention and the dense layers between MoE ones (the targets
# ember's refusal of `all` suggests); peft 0.21 aims Qwen3-MoE's and DeepSeek's gate_proj/up_proj/down_proj targets at
# the fused experts, so the export names those dense layers in target_parameters
DENSE_TARGETS = "lora.targets=[attn,feed_forward.w1,feed_forward.w2,feed_forward.w3]"
TARGETS = {"qwen3_moe": DENSE_TARGETS, "llama4": DENSE_TARGETS, "deepseek_v3": DENSE_TARGETS}
# the HF names of the attention projections the adapter targets
ATTENTION = {"deepseek_v3": {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_peft_adapter_applies_in_peft_with_ember_logits(tmp_path, family):
    import peft  # the test extra installs it: never skipped
    from transformers import AutoModelForCausalLM

    common = [f"model.family={family}", "model.flavor=debug", *SMALL, *FAMILIES[family]]
    Trainer(run_lib.load_config("debug", common + ["max_steps=1", f"output_dir={tmp_path / 'base'}"])).train()
    convert(tmp_path / "base", tmp_path / "base_hf", "hf")
    Trainer(run_lib.load_config("debug", common + ["max_steps=3", "lora.rank=4", "lora.alpha=8",
                                                   TARGETS.get(family, "lora.targets=all"),
                                                   f"model.init_from={tmp_path / 'base'}",
                                                   f"output_dir={tmp_path / 'lora'}"])).train()
    convert(tmp_path / "lora", tmp_path / "adapter", "peft")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    # full module names where leaves would over-reach
    leaves = {name.rsplit(".", 1)[-1] for name in config["target_modules"]}
    assert ATTENTION.get(family, {"q_proj", "k_proj", "v_proj", "o_proj"}) <= leaves
    hf_base = AutoModelForCausalLM.from_pretrained(tmp_path / "base_hf", dtype=torch.float32).eval()
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        base_logits = hf_base(tokens).logits
        torch.testing.assert_close(base_logits, load_model(tmp_path / "base")(tokens), rtol=1e-5, atol=1e-5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            adapted = peft.PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()
        # peft adapts exactly what ember did: Llama 4's shared experts were wrapped too, their keys "missing";
        # DeepSeek's and Qwen3-MoE's fused experts in place of the dense layers' gate_proj/up_proj/down_proj
        assert not [w for w in caught if "missing adapter keys" in str(w.message)]
        assert _wrapped(adapted) == _adapted(tmp_path / "adapter")
        got = adapted(tokens).logits
        expected = load_model(tmp_path / "lora")(tokens)
        assert (expected - base_logits).abs().max() > 1e-3  # the adapter changed the model
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(load_model(tmp_path / "adapter")(tokens), expected, rtol=1e-5, atol=1e-5)


def _wrapped(model) -> set[str]:
    """The HF modules a PeftModel wraps with a LoRA layer (a module whose parameter it adapts, once)."""
    import peft

    return {name.removeprefix(PREFIX) for name, module in model.named_modules()
            if isinstance(module, peft.tuners.lora.LoraLayer) and not name.endswith(".base_layer")}


def _adapted(adapter: Path) -> set[str]:
    """The HF modules a peft adapter directory holds adapters for."""
    return {key.removeprefix(PREFIX).rsplit(".lora_", 1)[0]
            for key in safetensors.torch.load_file(adapter / "adapter_model.safetensors")}


def _lora_model(family: str, overrides: dict, targets: list[str], hf_dir: Path | None = None):
    """A small model of `family` (2 layers unless `overrides` say otherwise) with adapters on `targets`: the model, its
    args and the adapters' state as a LoRA checkpoint holds them. With `hf_dir`: initialised weights, written there as
    the base's HF directory before the adapters are added, and a random B, so that the adapters change the logits
    (without, only names and shapes count)."""
    from ember.finetune.lora import apply_lora, init_lora, trainable_state_dict
    from ember.model_io.convert import save_hf
    from ember.models import MODELS, build_model_args

    args = build_model_args(family, "debug", {"n_layers": 2, "dim": 64, "n_heads": 4, "vocab_size": 128,
                                              "ffn_hidden_dim": 96, **overrides})
    torch.manual_seed(0)
    model = MODELS[family].model_cls(args)
    if hf_dir is not None:
        model.init_weights()
        save_hf(model, args, hf_dir)
    apply_lora(model, 4, 8.0, targets=targets, family=family)
    init_lora([model], seed=0)
    if hf_dir is not None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".lora_B." in name:
                    param.copy_(0.3 * torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
    return model.eval(), args, {k: v.detach() for k, v in trainable_state_dict([model]).items()}


def _lora_llama4(targets: list[str]):
    """A small Llama 4 (layers 0 and 2 dense, 1 and 3 with experts and the shared expert) with adapters on `targets`,
    its args and the adapters' state as a LoRA checkpoint holds them."""
    _, args, state = _lora_model("llama4", {"n_layers": 4, "n_kv_heads": 2, "moe_hidden_dim": 32, "n_experts": 4},
                                 targets)
    return args, state


SETTINGS = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "train_embeddings": False, "train_norms": False}
# Layer 0 dense, layer 1 with experts (DeepSeek's with a shared expert); adapters on attention, the dense SwiGLU, the
# shared expert and the router: every linear layer a MoE model's LoRA may adapt.
_DENSE = ["attn", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]
_DEEPSEEK = ({"n_kv_heads": None, "moe_hidden_dim": 32, "n_experts": 8, "top_k": 2},
             [*_DENSE, "moe.shared_expert.w1", "moe.shared_expert.w2", "moe.shared_expert.w3", "moe.router.gate"])
MOE_PEFT = {"deepseek_v3": _DEEPSEEK, "deepseek_v2": _DEEPSEEK,
            "qwen3_moe": ({"n_kv_heads": 2, "moe_hidden_dim": 32, "n_experts": 4, "top_k": 2, "dense_layers": (0,)},
                          [*_DENSE, "moe.router.gate"])}


@pytest.mark.parametrize("family", sorted(MOE_PEFT))
def test_moe_models_dense_layer_adapters_load_in_peft_with_ember_logits(tmp_path, family):
    # peft 0.21 aims gate_proj/up_proj/down_proj and gate (full module names too) at the MoE layers' fused experts and
    # router for these model types: the dense layer's and shared expert's adapters were dropped and the experts got
    # one of their own (logits up to 8.55 off). Those layers are now named by their weights in target_parameters.
    import peft
    from transformers import AutoModelForCausalLM

    from ember.finetune.peft_format import save_peft

    overrides, targets = MOE_PEFT[family]
    model, args, state = _lora_model(family, overrides, targets, hf_dir=tmp_path / "base")
    save_peft({"family": family, "lora": SETTINGS, "base": None}, args, state, tmp_path / "adapter")
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' deprecation notes
        hf_base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
        base_logits = hf_base(tokens).logits
        loaded = peft.PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()
        assert _wrapped(loaded) == _adapted(tmp_path / "adapter")  # each dense layer and shared expert, not the experts
        expected = model(tokens)
        assert (expected - base_logits).abs().max() > 0.1
        torch.testing.assert_close(loaded(tokens).logits, expected, rtol=1e-5, atol=1e-5)


def test_a_peft_export_of_an_adapter_it_cannot_name_is_one_line(tmp_path):
    # Mixtral's router has no HF module name in ember's peft mapping: a KeyError traceback before
    from ember.finetune.peft_format import save_peft

    _, args, state = _lora_model("mixtral", {"n_kv_heads": 2, "n_experts": 4, "top_k": 2}, ["attn", "moe.router.gate"])
    with pytest.raises(CheckpointError) as info:
        save_peft({"family": "mixtral", "lora": SETTINGS, "base": None}, args, state, tmp_path / "adapter")
    assert str(info.value) == ("the adapter on layers.0.moe.router.gate has no Hugging Face module name that ember "
                               "writes for peft; export the LoRA run merged into its base with --merge")
    assert not (tmp_path / "adapter").exists()


def test_llama4_peft_targets_are_exactly_the_adapted_modules(tmp_path):
    # bare gate_proj/up_proj/down_proj made peft wrap every MoE layer's feed_forward.shared_expert.* as well, and warn
    # "Found missing adapter keys" for them
    import peft
    import transformers

    from ember.finetune.peft_format import save_peft
    from ember.models.llama4 import hf

    args, state = _lora_llama4(["attn", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"])
    save_peft({"family": "llama4", "lora": SETTINGS, "base": None}, args, state, tmp_path)
    targets = json.loads((tmp_path / "adapter_config.json").read_text())["target_modules"]
    attention = [f"model.layers.{i}.self_attn.{m}_proj" for i in range(4) for m in "kqov"]
    dense = [f"model.layers.{i}.feed_forward.{m}_proj" for i in (0, 2) for m in ("down", "gate", "up")]
    assert targets == sorted(attention + dense)
    config = {k: v for k, v in hf.hf_config_from_args(args).items() if k not in ("architectures", "model_type")}
    base = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(**config))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = peft.PeftModel.from_pretrained(base, tmp_path)
    assert not [w for w in caught if "missing adapter keys" in str(w.message)]
    wrapped = [n.removeprefix("base_model.model.") for n, m in model.named_modules()
               if isinstance(m, peft.tuners.lora.LoraLayer)]
    assert sorted(wrapped) == targets


def test_llama4_attention_only_keeps_peft_s_short_names(tmp_path):
    # q_proj ... o_proj name exactly the adapted modules: the adapter config stays as peft users write it
    from ember.finetune.peft_format import save_peft

    args, state = _lora_llama4(["attn"])
    save_peft({"family": "llama4", "lora": SETTINGS, "base": None}, args, state, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]


@pytest.mark.parametrize("family, targets, adapted", [
    ("deepseek_v3", ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
     ["wq_a", "wq_b", "wkv_a", "wkv_b", "wo"]),  # the names `ember convert --to peft` writes for MLA
    ("deepseek_v2", ["q_proj", "kv_b_proj"], ["wq", "wkv_b"]),
    ("deepseek_v3", ["wq_a", "attention.wkv_b"], ["wq_a", "wkv_b"]),
])
def test_deepseek_targets_take_ember_and_hf_names(family, targets, adapted):
    from ember.finetune.lora_targets import resolve_targets
    from ember.models import MODELS, build_model_args

    with torch.device("meta"):
        model = MODELS[family].model_cls(build_model_args(family, "debug"))
    found = resolve_targets(model, targets, 4, family)
    assert found == [f"layers.{i}.attention.{m}" for i in range(4) for m in adapted]


def test_a_deepseek_target_it_lacks_lists_mla_s_own_names():
    # the message used to recommend wq, wk, wv: MLA has none of them (V3 has no wq either: q goes through a latent)
    from ember.errors import ConfigError
    from ember.finetune.lora_targets import resolve_targets
    from ember.models import MODELS, build_model_args

    with torch.device("meta"):
        model = MODELS["deepseek_v3"].model_cls(build_model_args("deepseek_v3", "debug"))
    with pytest.raises(ConfigError) as info:
        resolve_targets(model, ["wq"], 4, "deepseek_v3")
    assert str(info.value) == (
        "lora.targets entry 'wq' matches no linear layer of deepseek_v3's blocks; choose all, attn, mlp or module "
        "names of its blocks: attention.wq_a, attention.wq_b, attention.wkv_a, attention.wkv_b, attention.wo, "
        "feed_forward.w1, feed_forward.w2, feed_forward.w3, moe.router.gate, moe.shared_expert.w1, "
        "moe.shared_expert.w2, moe.shared_expert.w3 (or as in HF: q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, "
        "o_proj)")
