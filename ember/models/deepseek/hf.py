"""Hugging Face DeepseekV3ForCausalLM and DeepseekV2ForCausalLM <-> ember: config fields and state-dict keys.

RoPE rows: V2 rotates consecutive pairs (complex form) and V3 with rope_interleave=true (its hub configs) takes
consecutive pairs too, as ember does, so no row moves; V3 with rope_interleave=false rotates half against half,
and the rope rows of q (each head's last qk_rope_head_dim) and of kv_a's shared key are permuted.
Experts are stored on the hub one matrix per expert (`mlp.experts.{e}.gate_proj`); transformers 5 saves them fused
(`mlp.experts.gate_up_proj`, `down_proj`). Both are read (qwen/hf.py's code); export writes the hub's form.
Multi-token-prediction layers (`model.layers.{n_layers}.*`, DeepSeek-V3's hub checkpoint) are skipped, as
transformers skips them.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ember.models.deepseek.args import DeepseekArgs
from ember.models.llama import hf as llama_hf
from ember.models.qwen import hf as qwen_hf

ARCHITECTURES = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM"}

_LAYER_KEYS = {  # ember key inside a layer -> HF key inside "model.layers.{i}."
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.router.score_bias": "mlp.gate.e_score_correction_bias",
    "moe.shared_expert.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_expert.w3.weight": "mlp.shared_experts.up_proj.weight",
    "moe.shared_expert.w2.weight": "mlp.shared_experts.down_proj.weight",
}
_LAYER_KEYS_FROM_HF = {v: k for k, v in _LAYER_KEYS.items()}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def family_of(args: DeepseekArgs) -> str:
    """The family (and Hugging Face model_type): V3's sigmoid router with its score bias, else V2's softmax one."""
    return "deepseek_v3" if args.score_func == "sigmoid" else "deepseek_v2"


def to_hf_key(key: str) -> str:
    parts = key.split(".", 2)  # "layers", "{i}", rest
    return llama_hf._TOP_KEYS.get(key) or f"model.layers.{parts[1]}.{_LAYER_KEYS[parts[2]]}"


def from_hf_key(key: str) -> str:
    """The ember key of a HF weight name; KeyError for a name these models do not have."""
    if key in llama_hf._TOP_KEYS_FROM_HF:
        return llama_hf._TOP_KEYS_FROM_HF[key]
    m = _LAYER.fullmatch(key)
    name = _LAYER_KEYS_FROM_HF.get(m.group(2)) if m else None
    if name is None:
        raise KeyError(f"'{key}' is not a weight of a DeepSeek-V2/V3 model")
    return f"layers.{m.group(1)}.{name}"


def _rope_rows(key: str, tensor: torch.Tensor, args: DeepseekArgs, to_hf: bool) -> torch.Tensor:
    """V3 with rope_interleave=false: the rope rows of q's heads and of kv_a's shared key between HF's half-split
    order and ember's consecutive pairs; any other tensor, or rope_interleave=true, as it is."""
    if args.rope_interleave or family_of(args) != "deepseek_v3":
        return tensor
    permute = llama_hf.permute_to_hf if to_hf else llama_hf.permute_from_hf
    if key.endswith(("attention.wq.weight", "attention.wq_b.weight")):
        heads = tensor.view(args.n_heads, args.head_dim, -1)  # (heads, nope + rope, in)
        nope, rope = heads.split([args.qk_nope_head_dim, args.qk_rope_head_dim], dim=1)
        rope = permute(rope.reshape(args.n_heads * args.qk_rope_head_dim, -1), args.n_heads)
        return torch.cat([nope, rope.view(args.n_heads, args.qk_rope_head_dim, -1)], dim=1).flatten(0, 1)
    if key.endswith("attention.wkv_a.weight"):
        latent, rope = tensor.split([args.kv_lora_rank, args.qk_rope_head_dim])
        return torch.cat([latent, permute(rope, 1)])
    return tensor


def tensor_to_hf(key: str, tensor: torch.Tensor, args: DeepseekArgs) -> torch.Tensor:
    return _rope_rows(key, tensor, args, to_hf=True)


def tensor_from_hf(ember_key: str, tensor: torch.Tensor, args: DeepseekArgs) -> torch.Tensor:
    return _rope_rows(ember_key, tensor, args, to_hf=False)


def _beyond_layers(key: str, args: DeepseekArgs) -> bool:
    """A multi-token-prediction layer (model.layers.{n_layers}.*), which neither transformers nor ember builds."""
    m = _LAYER.fullmatch(key)
    return m is not None and int(m.group(1)) >= args.n_layers


def skip_hf_key(key: str, args: DeepseekArgs) -> bool:
    """Entries of a HF state dict with no ember counterpart: rotary buffers, MTP layers."""
    return key.endswith("rotary_emb.inv_freq") or _beyond_layers(key, args)


def to_hf_state_dict(state: dict[str, torch.Tensor], args: DeepseekArgs) -> dict[str, torch.Tensor]:
    """ember -> HF, as the hub stores it: one matrix per expert."""
    experts = {k: v for k, v in state.items() if ".moe.experts." in k}
    out = qwen_hf.to_hf_state_dict(experts, args)  # type: ignore[arg-type]  # the per-expert split
    for key, tensor in state.items():
        if key not in experts:
            out[to_hf_key(key)] = tensor_to_hf(key, tensor, args)
    return out


def from_hf_state_dict(state: dict[str, torch.Tensor], args: DeepseekArgs) -> dict[str, torch.Tensor]:
    """HF -> ember; per-expert or fused experts are stacked (qwen/hf.py); MTP layers and rotary buffers dropped."""
    is_expert = lambda key: ".mlp.experts." in key  # noqa: E731
    out = qwen_hf.from_hf_state_dict({k: v for k, v in state.items() if is_expert(k) and not _beyond_layers(k, args)},
                                     args)  # type: ignore[arg-type]
    for key, tensor in state.items():
        if not (is_expert(key) or skip_hf_key(key, args)):
            ember_key = from_hf_key(key)
            out[ember_key] = tensor_from_hf(ember_key, tensor, args)
    return out


def _yarn(config: dict[str, Any]) -> dict[str, Any]:
    """The YaRN fields of DeepseekArgs from config.json's rope_parameters (transformers 5) or rope_scaling."""
    rope = llama_hf._rope_parameters(config)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return dict(yarn_factor=None)
    if kind != "yarn":
        raise ValueError(f"RoPE type '{kind}' is not supported for DeepSeek (ember implements 'default' and 'yarn')")
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or config["max_position_embeddings"] / original  # transformers' default
    return dict(yarn_factor=float(factor), yarn_original_max_seq_len=original,
                yarn_beta_fast=float(rope.get("beta_fast") or 32), yarn_beta_slow=float(rope.get("beta_slow") or 1),
                yarn_mscale=rope.get("mscale"), yarn_mscale_all_dim=rope.get("mscale_all_dim"),
                yarn_attention_factor=rope.get("attention_factor"), yarn_truncate=bool(rope.get("truncate", True)))


def _routing(config: dict[str, Any], kind: str) -> dict[str, Any]:
    """The router's fields as transformers runs them: V3 sigmoid, group-limited by the sum of each group's two best
    scores, with the score bias; V2 softmax, greedy or group-limited by each group's best, never renormalised."""
    if kind == "deepseek_v3":
        return dict(score_func="sigmoid", n_groups=config.get("n_group") or 1,
                    topk_groups=config.get("topk_group") or 1,
                    norm_topk_prob=bool(config.get("norm_topk_prob", True)), score_bias=True)
    method = config.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"topk_method '{method}' is not one transformers' DeepSeek-V2 runs "
                         "(greedy, group_limited_greedy)")
    grouped = method == "group_limited_greedy"
    # transformers' V2 router never renormalises the top-k weights, whatever norm_topk_prob says
    return dict(score_func="softmax", n_groups=config["n_group"] if grouped else 1,
                topk_groups=config["topk_group"] if grouped else 1, norm_topk_prob=False, score_bias=False)


def args_from_hf_config(config: dict[str, Any]) -> DeepseekArgs:
    """DeepseekArgs for a DeepSeek-V3/V2 config.json; ValueError for what ember's DeepSeek cannot express."""
    kind = config["model_type"]
    heads = config["num_attention_heads"]
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act='{config['hidden_act']}' is not supported (DeepSeek's SwiGLU uses silu)")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError("attention_bias/mlp_bias=true are not supported (ember's DeepSeek has no biases)")
    if config.get("quantization_config"):  # the hub's DeepSeek-V3: fp8 blocks with weight_scale_inv beside them
        method = config["quantization_config"].get("quant_method", "?")
        raise ValueError(f"quantization_config ({method}) is not supported: ember reads unquantized weights; convert "
                         "the checkpoint to bf16 first (DeepSeek-V3's inference/fp8_cast_bf16.py)")
    if config.get("tie_word_embeddings"):
        raise ValueError("tie_word_embeddings=true is not supported for DeepSeek (no DeepSeek checkpoint ties them)")
    if (config.get("num_key_value_heads") or heads) != heads:
        raise ValueError(f"num_key_value_heads={config['num_key_value_heads']} differs from "
                         f"num_attention_heads={heads}; MLA shares one latent by all heads, "
                         "as every DeepSeek config does")
    return DeepseekArgs(
        dim=config["hidden_size"], n_layers=config["num_hidden_layers"], n_heads=heads, vocab_size=config["vocab_size"],
        ffn_hidden_dim=config["intermediate_size"], q_lora_rank=config.get("q_lora_rank") or None,
        kv_lora_rank=config["kv_lora_rank"], qk_nope_head_dim=config["qk_nope_head_dim"],
        qk_rope_head_dim=config["qk_rope_head_dim"], v_head_dim=config["v_head_dim"],
        rope_interleave=bool(config.get("rope_interleave", True)) if kind == "deepseek_v3" else True,
        n_experts=config["n_routed_experts"], top_k=config["num_experts_per_tok"],
        moe_hidden_dim=config["moe_intermediate_size"], n_shared_experts=config.get("n_shared_experts") or 0,
        n_dense_layers=config.get("first_k_dense_replace") or 0,
        route_scale=float(config.get("routed_scaling_factor", 1.0)),
        **_routing(config, kind), norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=float(llama_hf._rope_parameters(config)["rope_theta"]),
        max_seq_len=config.get("max_position_embeddings", 4096),
        **_yarn(config),
    )


def hf_config_from_args(args: DeepseekArgs) -> dict[str, Any]:
    """A config.json that transformers' DeepseekV3/V2ForCausalLM loads as this model."""
    kind = family_of(args)
    if args.tie_embeddings:
        raise ValueError("model.tie_embeddings=true is not exported to Hugging Face for DeepSeek (ember reads and "
                         "writes untied DeepSeek checkpoints only); export with --to torch")
    if kind == "deepseek_v3" and not args.score_bias:
        raise ValueError("model.score_bias=false has no DeepSeek-V3 class in transformers (its router always adds "
                         "e_score_correction_bias); export with --to torch")
    if kind == "deepseek_v2" and (args.score_bias or args.norm_topk_prob):
        raise ValueError("DeepSeek-V2's softmax router in transformers has no score bias and never renormalises the "
                         "top-k weights; set model.score_bias=false and model.norm_topk_prob=false, "
                         "or export with --to torch")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.yarn_factor is not None:
        rope.update(rope_type="yarn", factor=args.yarn_factor,
                    original_max_position_embeddings=args.yarn_original_max_seq_len, beta_fast=args.yarn_beta_fast,
                    beta_slow=args.yarn_beta_slow, mscale=args.yarn_mscale,
                    mscale_all_dim=args.yarn_mscale_all_dim, truncate=args.yarn_truncate)
        if args.yarn_attention_factor is not None:
            rope["attention_factor"] = args.yarn_attention_factor
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[kind]], "model_type": kind, "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_heads,
        "vocab_size": args.vocab_size, "intermediate_size": args.ffn_hidden_dim, "q_lora_rank": args.q_lora_rank,
        "kv_lora_rank": args.kv_lora_rank, "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim, "v_head_dim": args.v_head_dim, "n_routed_experts": args.n_experts,
        "num_experts_per_tok": args.top_k, "moe_intermediate_size": args.moe_hidden_dim,
        "n_shared_experts": args.n_shared_experts, "first_k_dense_replace": args.n_dense_layers,
        "routed_scaling_factor": args.route_scale, "norm_topk_prob": args.norm_topk_prob,
        "rms_norm_eps": args.norm_eps, "max_position_embeddings": args.max_seq_len, "rope_parameters": rope,
        "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
        "torch_dtype": "float32",
    }
    if kind == "deepseek_v3":
        config.update(n_group=args.n_groups, topk_group=args.topk_groups, rope_interleave=args.rope_interleave,
                      num_nextn_predict_layers=0)
    else:
        grouped = args.n_groups > 1
        config.update(topk_method="group_limited_greedy" if grouped else "greedy",
                      n_group=args.n_groups if grouped else None, topk_group=args.topk_groups if grouped else None)
    return config
