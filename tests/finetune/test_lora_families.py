"""LoRA on the families added on the shared decoder (Qwen2's biased projections, Qwen3's q/k norms and wide
heads, Qwen3-MoE's attention, Mistral's sliding window, Llama 4's dense and shared-expert SwiGLUs, DeepSeek-V3's MLA projections): trained by ember, exported as a peft adapter that
peft applies to transformers' own model with ember's logits, and folded back by ember."""

import json

import pytest
import torch

from ember import run as run_lib
from ember.convert import convert
from ember.load import load_model
from ember.train import Trainer

SMALL = ["model.n_layers=2", "model.dim=64", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=512",
         "data.dataset=synthetic", "seq_len=32", "global_batch_size=8", "micro_batch_size=8", "logging_steps=1",
         "eval_batches=1", "metrics.console=false", "metrics.tensorboard=false", "optim.lr=1e-2"]
FAMILIES = {
    "qwen2": ["model.ffn_hidden_dim=96"],
    "qwen3": ["model.ffn_hidden_dim=96"],  # the debug flavor's 64-wide heads: 4 x 64 from a width of 64
    "qwen3_moe": ["model.ffn_hidden_dim=96", "model.moe_hidden_dim=32", "model.n_experts=4", "model.top_k=2"],
    "mistral": ["model.ffn_hidden_dim=96", "model.sliding_window=8"],
    "gemma3": ["model.ffn_hidden_dim=96", "model.sliding_window=8"],  # 2 local layers (global every 6th)
    # layer 0 dense with chunked RoPE, layer 1 NoPE with experts and the shared expert
    "llama4": ["model.ffn_hidden_dim=96", "model.moe_hidden_dim=32", "model.n_experts=4", "model.nope_every=2",
               "model.attention_chunk=8", "model.floor_scale=4"],
    # MLA's five projections (q through its latent); layer 0 dense, layer 1 with 8 grouped experts and the shared one
    "deepseek_v3": ["model.n_kv_heads=null", "model.ffn_hidden_dim=96", "model.moe_hidden_dim=32", "model.n_experts=8",
                    "model.top_k=2"],
}
# experts are stacked weights, not nn.Linear: LoRA adapts attention, and Llama 4's dense layers between MoE ones
TARGETS = {"qwen3_moe": "lora.targets=attn",
           "llama4": "lora.targets=[attn,feed_forward.w1,feed_forward.w2,feed_forward.w3]",
           # attention only: peft 0.21 maps a deepseek_v3 adapter's gate_proj/up_proj/down_proj targets onto the fused
           # experts' parameters (transformers_weight_conversion.py), so a dense layer's adapters would not load there
           "deepseek_v3": "lora.targets=attn"}
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
    assert ATTENTION.get(family, {"q_proj", "k_proj", "v_proj", "o_proj"}) <= set(config["target_modules"])
    hf_base = AutoModelForCausalLM.from_pretrained(tmp_path / "base_hf", dtype=torch.float32).eval()
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        base_logits = hf_base(tokens).logits
        torch.testing.assert_close(base_logits, load_model(tmp_path / "base")(tokens), rtol=1e-5, atol=1e-5)
        got = peft.PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()(tokens).logits
        expected = load_model(tmp_path / "lora")(tokens)
        assert (expected - base_logits).abs().max() > 1e-3  # the adapter changed the model
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(load_model(tmp_path / "adapter")(tokens), expected, rtol=1e-5, atol=1e-5)
