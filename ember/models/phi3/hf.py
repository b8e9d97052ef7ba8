"""Hugging Face Phi3ForCausalLM <-> ember: config fields and state-dict keys.

Phi-3's checkpoints fuse q, k and v into `self_attn.qkv_proj` (q's rows, then k's, then v's) and the SwiGLU's
gate and up into `mlp.gate_up_proj` (gate's rows first). ember splits them on import and concatenates them on
export; the q and k rows are permuted between RoPE conventions as Llama's (ember/models/llama/hf.py). Every other
name is Llama's.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ember.models.llama import hf as llama_hf
from ember.models.phi3.args import Phi3Args


def family_of(args: Phi3Args) -> str:
    return "phi3"  # one family per args class


def _permute(w: torch.Tensor, n_heads: int, args: Phi3Args, to_hf: bool) -> torch.Tensor:
    """Llama's RoPE row permutation on the rows RoPE turns: each head's first rotary_dim (all of them unless
    the rotary embedding is partial, Phi-4-mini's); the other rows pass through in place."""
    permute = llama_hf.permute_to_hf if to_hf else llama_hf.permute_from_hf
    if args.rotary_dim == args.head_dim:
        return permute(w, n_heads)
    heads = w.view(n_heads, args.head_dim, -1)
    turned = permute(heads[:, :args.rotary_dim].reshape(n_heads * args.rotary_dim, -1), n_heads)
    return torch.cat([turned.view(n_heads, args.rotary_dim, -1), heads[:, args.rotary_dim:]], dim=1).reshape(w.shape)


_QKV = re.compile(r"model\.layers\.(\d+)\.self_attn\.qkv_proj\.weight")
_GATE_UP = re.compile(r"model\.layers\.(\d+)\.mlp\.gate_up_proj\.weight")


def to_hf_state_dict(state: dict[str, torch.Tensor], args: Phi3Args) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    fused = {"attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "feed_forward.w1.weight",
             "feed_forward.w3.weight"}
    for key, tensor in state.items():
        if args.tie_embeddings and key == "output.weight":
            continue
        parts = key.split(".", 2)
        if len(parts) == 3 and parts[2] in fused:
            continue  # written below, fused
        out[llama_hf.to_hf_key(key)] = tensor
    for layer in sorted({int(k.split(".")[1]) for k in state if k.startswith("layers.")}):
        prefix = f"layers.{layer}."
        q = _permute(state[prefix + "attention.wq.weight"], args.n_heads, args, to_hf=True)
        k = _permute(state[prefix + "attention.wk.weight"], args.kv_heads, args, to_hf=True)
        out[f"model.layers.{layer}.self_attn.qkv_proj.weight"] = torch.cat(
            [q, k, state[prefix + "attention.wv.weight"]])
        out[f"model.layers.{layer}.mlp.gate_up_proj.weight"] = torch.cat(
            [state[prefix + "feed_forward.w1.weight"], state[prefix + "feed_forward.w3.weight"]])
    return out


def from_hf_state_dict(state: dict[str, torch.Tensor], args: Phi3Args) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    q_rows, kv_rows = args.n_heads * args.head_dim, args.kv_heads * args.head_dim
    for key, tensor in state.items():
        if llama_hf.skip_hf_key(key, args):  # type: ignore[arg-type]
            continue
        if m := _QKV.fullmatch(key):
            q, k, v = tensor.split([q_rows, kv_rows, kv_rows])
            prefix = f"layers.{m.group(1)}.attention."
            out[prefix + "wq.weight"] = _permute(q, args.n_heads, args, to_hf=False)
            out[prefix + "wk.weight"] = _permute(k, args.kv_heads, args, to_hf=False)
            out[prefix + "wv.weight"] = v
        elif m := _GATE_UP.fullmatch(key):
            out[f"layers.{m.group(1)}.feed_forward.w1.weight"], out[f"layers.{m.group(1)}.feed_forward.w3.weight"] = \
                tensor.chunk(2)
        else:
            out[llama_hf.from_hf_key(key)] = tensor
    if args.tie_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def args_from_hf_config(config: dict[str, Any]) -> Phi3Args:
    """Phi3Args for a Phi3ForCausalLM config.json; ValueError for what ember's Phi-3 cannot express yet."""
    rope = llama_hf._rope_parameters(config)
    if rope["rope_type"] not in ("default", "longrope"):
        raise ValueError(f"RoPE type '{rope['rope_type']}' is not supported for phi3 (ember implements 'default' "
                         "and the 128K models' 'longrope')")
    longrope: dict[str, Any] = {}
    if rope["rope_type"] == "longrope":
        longrope = dict(rope_short_factor=tuple(float(f) for f in rope["short_factor"]),
                        rope_long_factor=tuple(float(f) for f in rope["long_factor"]),
                        rope_original_max_seq_len=int(rope.get("original_max_position_embeddings")
                                                      or config["original_max_position_embeddings"]),
                        rope_attention_factor=rope.get("attention_factor"))
        if rope.get("factor") is not None:
            raise ValueError("LongRoPE with an explicit 'factor' is not supported for phi3 (its attention factor "
                             "comes from max_position_embeddings / original_max_position_embeddings)")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act='{config['hidden_act']}' is not supported (Phi-3's SwiGLU uses silu)")
    return Phi3Args(
        dim=config["hidden_size"], n_layers=config["num_hidden_layers"], n_heads=config["num_attention_heads"],
        n_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        vocab_size=config["vocab_size"], ffn_hidden_dim=config["intermediate_size"],
        head_dim_override=llama_hf.explicit_head_dim(config), norm_eps=config.get("rms_norm_eps", 1e-5),
        rope_theta=float(rope["rope_theta"]), max_seq_len=config.get("max_position_embeddings", 4096),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)), sliding_window=config.get("sliding_window"),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))),
        **longrope,
    )


def hf_config_from_args(args: Phi3Args) -> dict[str, Any]:
    """A config.json that transformers' Phi3ForCausalLM loads as this model."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta,
                            "partial_rotary_factor": args.partial_rotary_factor}
    if args.rope_short_factor is not None:
        rope.update(rope_type="longrope", short_factor=list(args.rope_short_factor),
                    long_factor=list(args.rope_long_factor or ()),
                    original_max_position_embeddings=args.rope_original_max_seq_len)
        if args.rope_attention_factor is not None:
            rope["attention_factor"] = args.rope_attention_factor
    return {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim,
        "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps, "max_position_embeddings": args.max_seq_len,
        "original_max_position_embeddings": args.rope_original_max_seq_len if args.rope_short_factor is not None
        else args.max_seq_len, "tie_word_embeddings": args.tie_embeddings, "hidden_act": "silu",
        "rope_theta": args.rope_theta, "partial_rotary_factor": args.partial_rotary_factor, "rope_parameters": rope,
        "sliding_window": args.sliding_window,
        # Phi3Config's defaults name token 32000 as padding, which would make transformers zero that embedding
        # row's gradient and refuse a smaller vocabulary; the tokenizer exported beside the weights names its own
        "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
    }
