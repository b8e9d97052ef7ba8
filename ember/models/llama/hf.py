"""Hugging Face LlamaForCausalLM <-> ember: config fields and state-dict keys.

HF applies RoPE with `rotate_half` (first half / second half of each head), Meta and ember rotate
interleaved pairs. The weights are the same up to a fixed permutation of the rows of wq and wk
(Meta's convert_llama_weights_to_hf `permute`): `to_hf` applies it, `from_hf` undoes it.
"""

from __future__ import annotations

from typing import Any

import torch

from ember.models.llama.args import LlamaArgs

# ember name (per layer, after "layers.{i}.") -> HF name (after "model.layers.{i}.")
_LAYER_KEYS = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_KEYS = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}


def _interleaved_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # rows of each head: (pair k, member j) -> (member j, pair k)
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _halves_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def to_hf_key(key: str) -> str:
    if key in _TOP_KEYS:
        return _TOP_KEYS[key]
    _, index, rest = key.split(".", 2)  # "layers.{i}.{rest}"
    return f"model.layers.{index}.{_LAYER_KEYS[rest]}"


_FROM_HF_LAYER = {v: k for k, v in _LAYER_KEYS.items()}
_FROM_HF_TOP = {v: k for k, v in _TOP_KEYS.items()}


def from_hf_key(key: str) -> str:
    if key in _FROM_HF_TOP:
        return _FROM_HF_TOP[key]
    if not key.startswith("model.layers."):
        raise KeyError(f"unexpected Hugging Face Llama weight '{key}'")
    _, _, index, rest = key.split(".", 3)
    if rest not in _FROM_HF_LAYER:
        raise KeyError(f"unexpected Hugging Face Llama weight '{key}'")
    return f"layers.{index}.{_FROM_HF_LAYER[rest]}"


def convert_tensor_to_hf(key: str, tensor: torch.Tensor, args: LlamaArgs) -> torch.Tensor:
    if key.endswith("attention.wq.weight"):
        return _interleaved_to_halves(tensor, args.n_heads)
    if key.endswith("attention.wk.weight"):
        return _interleaved_to_halves(tensor, args.kv_heads)
    return tensor


def convert_tensor_from_hf(ember_key: str, tensor: torch.Tensor, args: LlamaArgs) -> torch.Tensor:
    if ember_key.endswith("attention.wq.weight"):
        return _halves_to_interleaved(tensor, args.n_heads)
    if ember_key.endswith("attention.wk.weight"):
        return _halves_to_interleaved(tensor, args.kv_heads)
    return tensor


def to_hf_state_dict(state_dict: dict[str, torch.Tensor], args: LlamaArgs) -> dict[str, torch.Tensor]:
    out = {}
    for key, tensor in state_dict.items():
        if key == "output.weight" and args.tie_embeddings:
            continue  # HF stores a tied lm_head once, as the embedding
        out[to_hf_key(key)] = convert_tensor_to_hf(key, tensor, args)
    return out


def from_hf_state_dict(state_dict: dict[str, torch.Tensor], args: LlamaArgs) -> dict[str, torch.Tensor]:
    out = {}
    for key, tensor in state_dict.items():
        if key.endswith("rotary_emb.inv_freq"):  # a buffer older transformers versions saved
            continue
        ember_key = from_hf_key(key)
        out[ember_key] = convert_tensor_from_hf(ember_key, tensor, args)
    if args.tie_embeddings:
        out.pop("output.weight", None)
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def _rope_params(config: dict[str, Any]) -> dict[str, Any]:
    # transformers >= 5 keeps RoPE settings in `rope_parameters`; older files use rope_theta + rope_scaling.
    params = dict(config.get("rope_parameters") or {})
    if not params:
        params = dict(config.get("rope_scaling") or {})
        params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    return params


def args_from_hf_config(config: dict[str, Any]) -> LlamaArgs:
    rope = _rope_params(config)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"rope type '{rope_type}' is not supported (ember has default and llama3 RoPE)")
    dim, hidden = config["hidden_size"], config["intermediate_size"]
    n_heads = config["num_attention_heads"]
    if config.get("head_dim") not in (None, dim // n_heads):
        raise ValueError(f"head_dim={config['head_dim']} != hidden_size/num_attention_heads is not supported")
    args = LlamaArgs(
        dim=dim,
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        vocab_size=config["vocab_size"],
        # multiple_of=hidden with no multiplier reproduces any intermediate_size >= 8/3 dim exactly;
        # smaller ones are expressed through ffn_dim_multiplier below.
        multiple_of=hidden,
        ffn_dim_multiplier=None,
        norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        max_seq_len=config.get("max_position_embeddings", 4096),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
    )
    if args.ffn_hidden_dim != hidden:
        args.ffn_dim_multiplier = hidden / int(2 * 4 * dim / 3)
        args.multiple_of = 1
        for nudge in (0.0, 1e-9, 1e-7):  # int() of a float product can land one below
            args.ffn_dim_multiplier = hidden / int(2 * 4 * dim / 3) + nudge
            if args.ffn_hidden_dim == hidden:
                break
        else:
            raise ValueError(f"cannot express intermediate_size={hidden} for hidden_size={dim}")
    if rope_type == "llama3":
        args.rope_scaling_factor = float(rope["factor"])
        args.rope_low_freq_factor = float(rope.get("low_freq_factor", 1.0))
        args.rope_high_freq_factor = float(rope.get("high_freq_factor", 4.0))
        args.rope_original_max_seq_len = int(rope["original_max_position_embeddings"])
    return args


def hf_config_from_args(args: LlamaArgs) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling_factor is not None:
        rope = {
            "rope_type": "llama3",
            "rope_theta": args.rope_theta,
            "factor": args.rope_scaling_factor,
            "low_freq_factor": args.rope_low_freq_factor,
            "high_freq_factor": args.rope_high_freq_factor,
            "original_max_position_embeddings": args.rope_original_max_seq_len,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "rope_theta": args.rope_theta,
        "rope_parameters": rope,
    }
