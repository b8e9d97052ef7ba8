"""Hugging Face Llama4ForCausalLM (model_type llama4_text) <-> ember: config fields and state-dict keys. The hub's
Scout and Maverick checkpoints (Llama4ForConditionalGeneration, model_type llama4) are read as their text model:
ember/model_io/hf_directory.py hands this module their text_config and text weights, as for every multimodal family.

No RoPE row permutation: HF's Llama 4 rotates consecutive pairs (complex multiplication), as ember does. The experts
are stored fused and transposed against ember's: gate_up_proj (E, dim, 2 x hidden), gate columns first, and
down_proj (E, hidden, dim).
"""

from __future__ import annotations

from typing import Any

import torch

from ember.models.llama import hf as llama_hf
from ember.models.llama4.args import Llama4Args

_LAYER_KEYS = {  # ember key inside a layer -> HF key inside "model.layers.{i}."
    **{k: v for k, v in llama_hf._LAYER_KEYS.items() if not k.startswith("feed_forward.")},
    "feed_forward.w1.weight": "feed_forward.gate_proj.weight",
    "feed_forward.w3.weight": "feed_forward.up_proj.weight",
    "feed_forward.w2.weight": "feed_forward.down_proj.weight",
    "moe.router.gate.weight": "feed_forward.router.weight",
    "moe.shared_expert.w1.weight": "feed_forward.shared_expert.gate_proj.weight",
    "moe.shared_expert.w3.weight": "feed_forward.shared_expert.up_proj.weight",
    "moe.shared_expert.w2.weight": "feed_forward.shared_expert.down_proj.weight",
}
_LAYER_KEYS_FROM_HF = {v: k for k, v in _LAYER_KEYS.items()}


def family_of(args: Llama4Args) -> str:
    return "llama4"


def to_hf_key(key: str) -> str:
    if key in llama_hf._TOP_KEYS:
        return llama_hf._TOP_KEYS[key]
    _, index, rest = key.split(".", 2)  # "layers.{i}.{rest}"
    if rest.startswith("moe.experts."):
        return f"model.layers.{index}.feed_forward.experts.{'down_proj' if rest.endswith('w2') else 'gate_up_proj'}"
    return f"model.layers.{index}.{_LAYER_KEYS[rest]}"


def from_hf_key(key: str) -> str:
    """The ember key of a HF weight name; KeyError for a name a Llama 4 text model does not have."""
    if key in llama_hf._TOP_KEYS_FROM_HF:
        return llama_hf._TOP_KEYS_FROM_HF[key]
    parts = key.split(".", 3)  # "model", "layers", "{i}", rest
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _LAYER_KEYS_FROM_HF:
        return f"layers.{parts[2]}.{_LAYER_KEYS_FROM_HF[parts[3]]}"
    raise KeyError(f"'{key}' is not a weight of a Llama 4 text model")


def tensor_to_hf(key: str, tensor: torch.Tensor, args: Llama4Args) -> torch.Tensor:
    """A non-expert tensor as HF holds it: unchanged (no RoPE permutation)."""
    return tensor


def tensor_from_hf(ember_key: str, tensor: torch.Tensor, args: Llama4Args) -> torch.Tensor:
    return tensor


def to_hf_state_dict(state: dict[str, torch.Tensor], args: Llama4Args) -> dict[str, torch.Tensor]:
    """ember -> HF Llama4ForCausalLM: the experts' matrices fused and transposed as transformers holds them."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if args.tie_embeddings and key == "output.weight":
            continue
        if key.endswith("moe.experts.w3"):
            continue  # fused with w1 below
        if key.endswith("moe.experts.w1"):
            w3 = state[key.removesuffix("w1") + "w3"]
            tensor = torch.cat([tensor, w3], dim=1).transpose(1, 2).contiguous()  # (E, dim, 2 x hidden)
        elif key.endswith("moe.experts.w2"):
            tensor = tensor.transpose(1, 2).contiguous()  # (E, hidden, dim)
        out[to_hf_key(key)] = tensor
    return out


def from_hf_state_dict(state: dict[str, torch.Tensor], args: Llama4Args) -> dict[str, torch.Tensor]:
    """HF (Llama4ForCausalLM) -> ember."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if llama_hf.skip_hf_key(name, args):  # type: ignore[arg-type]
            continue
        if name.endswith("feed_forward.experts.gate_up_proj"):
            layer = name.split(".")[2]
            w1, w3 = tensor.transpose(1, 2).chunk(2, dim=1)  # (E, 2 x hidden, dim): gate rows first
            out[f"layers.{layer}.moe.experts.w1"], out[f"layers.{layer}.moe.experts.w3"] = w1, w3
        elif name.endswith("feed_forward.experts.down_proj"):
            out[f"layers.{name.split('.')[2]}.moe.experts.w2"] = tensor.transpose(1, 2)
        else:
            out[from_hf_key(name)] = tensor
    if args.tie_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def _every(flags: list[bool], what: str, key: str) -> int:
    """n where flags[i] is (i + 1) % n == 0 for every layer; ValueError where no such n states the list."""
    n = len(flags)
    for every in range(1, n + 2):
        if flags == [(i + 1) % every == 0 for i in range(n)]:
            return every
    raise ValueError(f"{key} {[i for i, flag in enumerate(flags) if flag]} do not fall every n-th layer; ember's "
                     f"Llama 4 places {what} at layers i with (i + 1) % n == 0")


def args_from_hf_config(config: dict[str, Any]) -> Llama4Args:
    """Llama4Args for a llama4_text config.json (a llama4 one's text_config); ValueError for what ember's Llama 4
    cannot express."""
    rope = llama_hf._rope_parameters(config)
    if rope["rope_type"] not in ("default", "llama3"):
        raise ValueError(f"RoPE type '{rope['rope_type']}' is not supported for llama4 "
                         "(ember implements 'default' and 'llama3')")
    if config.get("hidden_act", "silu") != "silu" or config.get("attention_bias"):
        raise ValueError("hidden_act other than silu or attention_bias=true is not supported (Llama 4 has neither)")
    n = config["num_hidden_layers"]
    step = config.get("interleave_moe_layer_step", 1)
    moe_layers = config.get("moe_layers")
    moe_layers = list(range(step - 1, n, step)) if moe_layers is None else moe_layers
    moe_every = _every([i in moe_layers for i in range(n)], "experts", "moe_layers")
    interval = config.get("no_rope_layer_interval", 4)
    uses_rope = config.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    nope_every = _every([not flag for flag in uses_rope], "layers without RoPE", "no_rope_layers' NoPE layers")
    expected = ["chunked_attention" if flag and config.get("attention_chunk_size") else "full_attention"
                for flag in uses_rope]
    if config.get("layer_types") not in (None, expected):
        raise ValueError(f"layer_types {config['layer_types']} differ from no_rope_layers' chunked layers, "
                         "which is all ember's Llama 4 expresses")
    scaling = llama_hf.llama31_scaling_fields(rope)
    return Llama4Args(
        dim=config["hidden_size"], n_layers=n, n_heads=config["num_attention_heads"],
        n_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        vocab_size=config["vocab_size"], head_dim_override=llama_hf.explicit_head_dim(config),
        ffn_hidden_dim=config["intermediate_size_mlp"], n_experts=config["num_local_experts"] if moe_layers else 0,
        top_k=config.get("num_experts_per_tok", 1), moe_hidden_dim=config["intermediate_size"], sparse_step=moe_every,
        nope_every=nope_every, attention_chunk=config.get("attention_chunk_size"),
        qk_norm=bool(config.get("use_qk_norm", True)),
        temperature_tuning=bool(config.get("attn_temperature_tuning", True)),
        floor_scale=int(config.get("floor_scale", 8192)), attn_scale=float(config.get("attn_scale", 0.1)),
        norm_eps=config.get("rms_norm_eps", 1e-5), rope_theta=float(rope["rope_theta"]),
        max_seq_len=config.get("max_position_embeddings", 131072),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)), **scaling,
    )


def hf_config_from_args(args: Llama4Args) -> dict[str, Any]:
    """A config.json that transformers' Llama4ForCausalLM loads as this model."""
    rope = llama_hf.rope_parameters(args)
    n = args.n_layers
    return {
        "architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text", "hidden_size": args.dim,
        "intermediate_size": args.moe_hidden_dim, "intermediate_size_mlp": args.ffn_hidden_dim, "num_hidden_layers": n,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim,
        "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps, "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
        "num_local_experts": args.n_experts, "num_experts_per_tok": args.top_k,
        "interleave_moe_layer_step": args.sparse_step, "moe_layers": [i for i in range(n) if args.is_moe_layer(i)],
        "no_rope_layer_interval": args.nope_every, "no_rope_layers": [int(args.uses_rope(i)) for i in range(n)],
        "attention_chunk_size": args.attention_chunk,
        "layer_types": ["chunked_attention" if args.layer_span(i) else "full_attention" for i in range(n)],
        "use_qk_norm": args.qk_norm, "attn_temperature_tuning": args.temperature_tuning,
        "floor_scale": args.floor_scale, "attn_scale": args.attn_scale, "rope_theta": args.rope_theta,
        "rope_parameters": rope, "output_router_logits": False, "router_jitter_noise": 0.0,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
    }
