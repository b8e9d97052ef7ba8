"""Hugging Face MistralForCausalLM <-> ember: the same weight names and RoPE row permutation as Llama
(ember/models/llama/hf.py); the config adds sliding_window."""

from __future__ import annotations

from typing import Any

import torch

from ember.models.llama import hf as llama_hf
from ember.models.mistral.args import MistralArgs

from_hf_key, to_hf_key = llama_hf.from_hf_key, llama_hf.to_hf_key


def family_of(args: MistralArgs) -> str:
    return "mistral"  # one family per args class


def tensor_to_hf(key: str, tensor: torch.Tensor, args: MistralArgs) -> torch.Tensor:
    return llama_hf.tensor_to_hf(key, tensor, args)  # type: ignore[arg-type]


def tensor_from_hf(ember_key: str, tensor: torch.Tensor, args: MistralArgs) -> torch.Tensor:
    return llama_hf.tensor_from_hf(ember_key, tensor, args)  # type: ignore[arg-type]


def to_hf_state_dict(state: dict[str, torch.Tensor], args: MistralArgs) -> dict[str, torch.Tensor]:
    return llama_hf.to_hf_state_dict(state, args)  # type: ignore[arg-type]


def from_hf_state_dict(state: dict[str, torch.Tensor], args: MistralArgs) -> dict[str, torch.Tensor]:
    return llama_hf.from_hf_state_dict(state, args)  # type: ignore[arg-type]


def args_from_hf_config(config: dict[str, Any]) -> MistralArgs:
    """MistralArgs for a MistralForCausalLM config.json; ValueError for what ember's Mistral cannot express."""
    rope = llama_hf._rope_parameters(config)
    if rope["rope_type"] != "default":
        raise ValueError(f"RoPE type '{rope['rope_type']}' is not supported for mistral (ember implements 'default')")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act='{config['hidden_act']}' is not supported (Mistral's SwiGLU uses silu)")
    return MistralArgs(
        dim=config["hidden_size"], n_layers=config["num_hidden_layers"], n_heads=config["num_attention_heads"],
        n_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        vocab_size=config["vocab_size"], ffn_hidden_dim=config["intermediate_size"],
        head_dim_override=llama_hf.explicit_head_dim(config), norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope["rope_theta"]), max_seq_len=config.get("max_position_embeddings", 32768),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)), sliding_window=config.get("sliding_window"),
    )


def hf_config_from_args(args: MistralArgs) -> dict[str, Any]:
    """A config.json that transformers' MistralForCausalLM loads as this model."""
    return {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim,
        "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps, "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings, "hidden_act": "silu", "rope_theta": args.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "sliding_window": args.sliding_window,
        # MistralConfig's defaults name tokens 1 and 2; the tokenizer exported beside the weights names its own
        "bos_token_id": None, "eos_token_id": None,
    }
