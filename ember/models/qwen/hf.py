"""Hugging Face Qwen2ForCausalLM, Qwen3ForCausalLM and Qwen3MoeForCausalLM <-> ember: config fields and
state-dict keys.

Names and the RoPE row permutation are Llama's (ember/models/llama/hf.py): Qwen's checkpoints rotate half
of each head against the other half, ember rotates consecutive pairs, so the rows of wq and wk are permuted
between the two, and with them everything that is laid out along those rows: the q/k biases (Qwen2) and the
q/k norms' weights, which run over one head's width before RoPE (Qwen3; permuted as a single head).
Experts are stored on the hub one matrix per expert (`mlp.experts.{e}.gate_proj`), which transformers reads;
transformers 5 saves them fused (`mlp.experts.gate_up_proj`, `down_proj`). Both are read; export writes the
hub's form.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ember.models.llama import hf as llama_hf
from ember.models.qwen.args import QwenArgs

ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}

_LAYER_KEYS = {  # ember key inside a layer -> HF key inside "model.layers.{i}."
    **llama_hf._LAYER_KEYS,
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
}
_LAYER_KEYS_FROM_HF = {v: k for k, v in _LAYER_KEYS.items()}
_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def family_of(args: QwenArgs) -> str:
    """The family (and Hugging Face model_type) these hyper-parameters are closest to: experts make Qwen3-MoE,
    q/k norms Qwen3, neither Qwen2."""
    if args.n_experts:
        return "qwen3_moe"
    return "qwen3" if args.qk_norm else "qwen2"


def model_type(args: QwenArgs) -> str:
    """The Hugging Face model_type these hyper-parameters are; ValueError where none of Qwen's is."""
    kind = family_of(args)
    if args.qkv_bias == args.qk_norm:
        # Qwen2 is biases without norms, Qwen3 and Qwen3-MoE norms without biases (transformers' Qwen3 biases o_proj
        # too when it has biases); any other mix is no Qwen class
        raise ValueError(f"model.qkv_bias={str(args.qkv_bias).lower()} with model.qk_norm={str(args.qk_norm).lower()} "
                         "matches no Qwen class of transformers (Qwen2: biases, no q/k norms; Qwen3: q/k norms, no "
                         "biases); export with --to torch")
    return kind


def to_hf_key(key: str) -> str:
    if key in llama_hf._TOP_KEYS:
        return llama_hf._TOP_KEYS[key]
    _, index, rest = key.split(".", 2)  # "layers.{i}.{rest}"
    return f"model.layers.{index}.{_LAYER_KEYS[rest]}"


def from_hf_key(key: str) -> str:
    """The ember key of a HF weight name; KeyError for a name these models do not have."""
    if key in llama_hf._TOP_KEYS_FROM_HF:
        return llama_hf._TOP_KEYS_FROM_HF[key]
    m = _LAYER.fullmatch(key)
    if m and m.group(2) in _LAYER_KEYS_FROM_HF:
        return f"layers.{m.group(1)}.{_LAYER_KEYS_FROM_HF[m.group(2)]}"
    raise KeyError(f"'{key}' is not a weight of a Qwen2/Qwen3/Qwen3-MoE model")


def tensor_to_hf(key: str, tensor: torch.Tensor, args: QwenArgs) -> torch.Tensor:
    return llama_hf.permute_rope_rows(key, tensor, args, to_hf=True)


def tensor_from_hf(ember_key: str, tensor: torch.Tensor, args: QwenArgs) -> torch.Tensor:
    return llama_hf.permute_rope_rows(ember_key, tensor, args, to_hf=False)


def to_hf_state_dict(state: dict[str, torch.Tensor], args: QwenArgs) -> dict[str, torch.Tensor]:
    """ember -> HF, as the hub stores it: one matrix per expert, no tied lm_head."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if args.tie_embeddings and key == "output.weight":
            continue
        if ".moe.experts." in key:  # layers.{i}.moe.experts.w1 -> one matrix per expert (views, no copy)
            layer, name = key.split(".")[1], key.split(".")[-1]
            for e in range(args.n_experts):
                out[f"model.layers.{layer}.mlp.experts.{e}.{_EXPERT_NAMES[name]}.weight"] = tensor[e]
        else:
            out[to_hf_key(key)] = tensor_to_hf(key, tensor, args)
    return out


def from_hf_state_dict(state: dict[str, torch.Tensor], args: QwenArgs) -> dict[str, torch.Tensor]:
    """HF -> ember; with tied embeddings output.weight is the embedding tensor itself."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    names_from_hf = {v: k for k, v in _EXPERT_NAMES.items()}
    for key, tensor in state.items():
        if key.endswith("rotary_emb.inv_freq") or (args.tie_embeddings and key == "lm_head.weight"):
            continue
        if m := _EXPERT.fullmatch(key):
            experts.setdefault((m.group(1), names_from_hf[m.group(3)]), {})[int(m.group(2))] = tensor
        elif m := _FUSED.fullmatch(key):
            prefix = f"layers.{m.group(1)}.moe.experts"
            if m.group(2) == "gate_up_proj":  # (E, 2H, D): the gate's rows (w1) first, then up's (w3)
                out[f"{prefix}.w1"], out[f"{prefix}.w3"] = tensor.chunk(2, dim=1)
            else:
                out[f"{prefix}.w2"] = tensor
        else:
            ember_key = from_hf_key(key)
            out[ember_key] = tensor_from_hf(ember_key, tensor, args)
    for (layer, name), per_expert in experts.items():
        if sorted(per_expert) != list(range(args.n_experts)):
            raise KeyError(f"layer {layer} {name}: the checkpoint has experts {sorted(per_expert)} of {args.n_experts}")
        out[f"layers.{layer}.moe.experts.{name}"] = torch.stack([per_expert[e] for e in range(args.n_experts)])
    if args.tie_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def _sliding(config: dict[str, Any]) -> dict[str, Any]:
    """sliding_window and max_window_layers as ember holds them; ValueError for a layer_types list that the
    two cannot express."""
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    first = config.get("max_window_layers", 0) if window is not None else 0
    n = config["num_hidden_layers"]
    expected = ["sliding_attention" if window is not None and i >= first else "full_attention" for i in range(n)]
    if config.get("layer_types") not in (None, expected):
        raise ValueError(f"layer_types {config['layer_types']} differ from use_sliding_window/max_window_layers' "
                         "layers, which is all ember's Qwen expresses")
    return {"sliding_window": window, "max_window_layers": first}


def args_from_hf_config(config: dict[str, Any]) -> QwenArgs:
    """QwenArgs for a Qwen2/Qwen3/Qwen3-MoE config.json; ValueError for what ember's Qwen cannot express."""
    kind = config["model_type"]
    rope = llama_hf._rope_parameters(config)
    if rope["rope_type"] != "default":
        raise ValueError(f"RoPE type '{rope['rope_type']}' is not supported for {kind} (ember implements 'default')")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act='{config['hidden_act']}' is not supported (Qwen's SwiGLU uses silu)")
    if kind != "qwen2" and config.get("attention_bias"):
        raise ValueError("attention_bias=true is not supported for Qwen3 (ember's Qwen3 has no biases)")
    moe: dict[str, Any] = {}
    if kind == "qwen3_moe":
        # the hub's configs say num_experts, transformers 5 writes num_local_experts
        moe = dict(n_experts=config.get("num_experts", config.get("num_local_experts")),
                   top_k=config["num_experts_per_tok"], moe_hidden_dim=config["moe_intermediate_size"],
                   norm_topk_prob=bool(config.get("norm_topk_prob", True)),
                   sparse_step=config.get("decoder_sparse_step", 1),
                   dense_layers=tuple(config.get("mlp_only_layers") or ()))
    return QwenArgs(
        dim=config["hidden_size"], n_layers=config["num_hidden_layers"], n_heads=config["num_attention_heads"],
        n_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        vocab_size=config["vocab_size"], ffn_hidden_dim=config["intermediate_size"],
        head_dim_override=llama_hf.explicit_head_dim(config), qkv_bias=kind == "qwen2", qk_norm=kind != "qwen2",
        norm_eps=config.get("rms_norm_eps", 1e-6), rope_theta=float(rope["rope_theta"]),
        max_seq_len=config.get("max_position_embeddings", 32768),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)), **_sliding(config), **moe,
    )


def hf_config_from_args(args: QwenArgs) -> dict[str, Any]:
    """A config.json that transformers' Qwen2/Qwen3/Qwen3-MoE class loads as this model."""
    kind = model_type(args)
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[kind]], "model_type": kind, "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim,
        "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps, "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings, "hidden_act": "silu", "rope_theta": args.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "use_sliding_window": args.sliding_window is not None, "sliding_window": args.sliding_window,
        "max_window_layers": args.max_window_layers if args.sliding_window is not None else args.n_layers,
        "layer_types": ["sliding_attention" if args.layer_span(i) else "full_attention" for i in range(args.n_layers)],
    }
    if kind != "qwen2":
        config["attention_bias"] = False
    if kind == "qwen3_moe":
        config.update(num_experts=args.n_experts, num_experts_per_tok=args.top_k,
                      moe_intermediate_size=args.moe_hidden_dim, norm_topk_prob=args.norm_topk_prob,
                      decoder_sparse_step=args.sparse_step, mlp_only_layers=list(args.dense_layers),
                      output_router_logits=False)
    return config
