"""Multi-head Latent Attention (ember/nn/mla.py) and YaRN (ember/nn/yarn.py) against transformers' DeepSeek-V3 and
V2 attention on small random configs: outputs and every gradient equal (fp32, 1e-5); the latent cache's absorbed
decode equal to the expanded form, caching only the latent."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3

from ember.nn.mla import MLA
from ember.nn.rope import RopeConfig, rope_cos_sin
from ember.nn.yarn import YarnScaling, yarn_softmax_mscale

YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=16, beta_fast=32,
            beta_slow=1, mscale=0.707, mscale_all_dim=0.707)
SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24, qk_nope_head_dim=12,
             qk_rope_head_dim=8, v_head_dim=10, max_position_embeddings=128, attn_implementation="eager")
KEYS = {"q_proj": "wq", "q_a_proj": "wq_a", "q_a_layernorm": "q_norm", "q_b_proj": "wq_b",
        "kv_a_proj_with_mqa": "wkv_a", "kv_a_layernorm": "kv_norm", "kv_b_proj": "wkv_b", "o_proj": "wo"}


def _rope(rope: dict, rope_dim: int, max_seq_len: int = 128) -> RopeConfig:
    """The RopeConfig of these HF rope parameters, as DeepseekArgs.rope makes it (YaRN's or none)."""
    yarn = None
    if rope.get("rope_type") == "yarn":
        yarn = YarnScaling(rope["factor"], rope["original_max_position_embeddings"], rope.get("beta_fast") or 32.0,
                           rope.get("beta_slow") or 1.0, rope.get("mscale"), rope.get("mscale_all_dim"),
                           rope.get("attention_factor"), rope.get("truncate", True))
    return RopeConfig(rope["rope_theta"], rope_dim, max_seq_len, yarn)


def _pair(version: int, q_lora_rank, rope: dict):
    """transformers' attention with visible random weights, and ember's MLA holding the same weights."""
    module = hf_v3 if version == 3 else hf_v2
    config_cls = transformers.DeepseekV3Config if version == 3 else transformers.DeepseekV2Config
    config = config_cls(**SMALL, q_lora_rank=q_lora_rank, rope_parameters=rope)
    attention_cls = module.DeepseekV3Attention if version == 3 else module.DeepseekV2Attention
    torch.manual_seed(0)
    theirs = attention_cls(config, layer_idx=0)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            p.uniform_(0.5, 1.5) if "layernorm" in name else p.normal_(0, 0.2)
    rope_config = _rope(config.rope_parameters, config.qk_rope_head_dim)
    ours = MLA(64, 4, q_lora_rank=q_lora_rank, kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8,
               v_head_dim=10, softmax_scale_factor=yarn_softmax_mscale(rope_config.scaling))
    ours.load_state_dict({KEYS[k.split(".")[0]] + "." + k.split(".", 1)[1]: v for k, v in theirs.state_dict().items()})
    rotary = (module.DeepseekV3RotaryEmbedding if version == 3 else module.DeepseekV2RotaryEmbedding)(config)
    return theirs, ours, rotary, rope_config


def _causal_mask(T: int) -> torch.Tensor:
    return torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]


@pytest.mark.parametrize("version, q_lora_rank, rope", [
    (3, 16, YARN),  # V3: q latent, interleaved RoPE rows (rope_interleave=True), YaRN with mscale 0.707
    (3, None, {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0}),  # V3's own mscales, a plain q projection
    (2, None, YARN),  # V2-Lite: no q latent, complex RoPE on consecutive pairs
    (2, 16, {"rope_type": "default", "rope_theta": 10000.0}),  # no YaRN: the plain softmax scale
])
def test_mla_matches_transformers_outputs_and_gradients(version: int, q_lora_rank, rope: dict):
    theirs, ours, rotary, rope_config = _pair(version, q_lora_rank, rope)
    T = 20
    x = torch.randn(2, T, 64, generator=torch.Generator().manual_seed(1))
    x_theirs, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    positions = torch.arange(T)[None]
    expected, _ = theirs(x_theirs, position_embeddings=rotary(x, positions), attention_mask=_causal_mask(T))
    cos, sin = rope_cos_sin(rope_config)
    got = ours(x_ours, cos[:T], sin[:T])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    weight = torch.randn_like(got, generator=torch.Generator().manual_seed(2))
    (expected * weight).sum().backward()
    (got * weight).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, rtol=1e-5, atol=1e-5)
    grads = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        hf_name = {v: k for k, v in KEYS.items()}[name.split(".")[0]] + "." + name.split(".", 1)[1]
        torch.testing.assert_close(p.grad, grads[hf_name].grad, rtol=1e-5, atol=1e-5, msg=name)


def test_yarn_tables_and_scale_equal_transformers():
    config = transformers.DeepseekV3Config(**SMALL, rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 0.5})
    rotary = hf_v3.DeepseekV3RotaryEmbedding(config)
    rope_config = _rope(config.rope_parameters, 8)
    cos, sin = rope_cos_sin(rope_config)
    hf_cos, hf_sin = rotary(torch.zeros(1), torch.arange(128)[None])
    assert rotary.attention_scaling != 1.0  # mscale / mscale_all_dim differ: the tables are scaled
    torch.testing.assert_close(cos, hf_cos[0, :, :4], rtol=0, atol=0)
    torch.testing.assert_close(sin, hf_sin[0, :, :4], rtol=0, atol=0)
    scale = hf_v3.DeepseekV3Attention(config, 0).scaling
    assert MLA(64, 4, q_lora_rank=None, kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
               softmax_scale_factor=yarn_softmax_mscale(rope_config.scaling)
               ).softmax_scale == pytest.approx(scale, rel=1e-12)


@pytest.mark.parametrize("static", [False, True])  # static: the whole preallocated length, masked, every step
def test_latent_cache_decodes_as_the_expanded_form_and_caches_only_the_latent(static: bool):
    _, ours, _, rope_config = _pair(3, 16, YARN)
    cos, sin = rope_cos_sin(rope_config)
    T, pad = 12, torch.tensor([0, 3])  # the second row's prompt is 3 tokens shorter, left padded
    x = torch.randn(2, T, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        cache = ours.kv_cache = ours.make_kv_cache(2, T, torch.float32, torch.device("cpu"))
        cache.static = static
        assert cache.c_kv.shape == (2, T, 24) and cache.k_rope.shape == (2, T, 8)
        assert not any(isinstance(v, torch.Tensor) and v.dim() == 4 for v in vars(cache).values())  # no k/v heads
        positions = (torch.arange(T)[None] - pad[:, None]).clamp_min(0)
        cache.set_positions(torch.arange(8), pad)  # prefill 8 slots, then decode 4 one at a time
        steps = [ours(x[:, :8], cos[positions[:, :8]], sin[positions[:, :8]])]
        for t in range(8, T):
            cache.set_positions(torch.tensor([t]), pad)
            steps.append(ours(x[:, t:t + 1], cos[positions[:, t:t + 1]], sin[positions[:, t:t + 1]]))
        ours.kv_cache = None
        for row in range(2):  # each row alone, unpadded, through the expanded (training) form
            p = int(pad[row])
            full = ours(x[row:row + 1, p:], cos[:T - p], sin[:T - p])
            torch.testing.assert_close(torch.cat(steps, dim=1)[row:row + 1, p:], full, rtol=1e-5, atol=1e-5)
