"""Hugging Face MixtralForCausalLM <-> ember: config fields and state-dict keys.

Attention and norms map as in the Llama family (q/k rows permuted between RoPE conventions). Experts
are stored on the hub one matrix per expert (`block_sparse_moe.experts.{e}.w1/w2/w3`), which both
transformers 4 and 5 read; transformers 5 saves them fused (`mlp.experts.gate_up_proj`, `down_proj`).
Both are read here; export writes the per-expert hub form.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ember.models.llama import hf as llama_hf
from ember.models.mixtral.args import MixtralArgs

_EXPERT = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")
_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_ROUTER = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.gate\.weight")


def family_of(args: MixtralArgs) -> str:
    return "mixtral"  # one family per args class


def args_from_hf_config(config: dict[str, Any]) -> MixtralArgs:
    rope = config.get("rope_parameters") or {}
    return MixtralArgs(
        dim=config["hidden_size"], n_layers=config["num_hidden_layers"], n_heads=config["num_attention_heads"],
        n_kv_heads=config.get("num_key_value_heads"), vocab_size=config["vocab_size"],
        ffn_hidden_dim=config["intermediate_size"], n_experts=config["num_local_experts"],
        top_k=config["num_experts_per_tok"], norm_eps=config.get("rms_norm_eps", 1e-5),
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 1e6))),
        max_seq_len=config.get("max_position_embeddings", 32768),
        head_dim_override=llama_hf.explicit_head_dim(config),
    )


def hf_config_from_args(args: MixtralArgs) -> dict[str, Any]:
    return {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim,
        "vocab_size": args.vocab_size, "num_local_experts": args.n_experts, "num_experts_per_tok": args.top_k,
        "rms_norm_eps": args.norm_eps, "max_position_embeddings": args.max_seq_len, "tie_word_embeddings": False,
        "hidden_act": "silu", "rope_theta": args.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "router_jitter_noise": 0.0, "output_router_logits": False,
    }


def from_hf_state_dict(state: dict[str, torch.Tensor], args: MixtralArgs) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for key, tensor in state.items():
        if m := _EXPERT.fullmatch(key):
            experts.setdefault((int(m.group(1)), m.group(3)), {})[int(m.group(2))] = tensor
        elif m := _FUSED.fullmatch(key):
            layer = int(m.group(1))
            if m.group(2) == "gate_up_proj":  # (E, 2H, D): gate (w1) rows first, then up (w3)
                w1, w3 = tensor.chunk(2, dim=1)
                out[f"layers.{layer}.moe.experts.w1"], out[f"layers.{layer}.moe.experts.w3"] = w1, w3
            else:
                out[f"layers.{layer}.moe.experts.w2"] = tensor
        elif m := _ROUTER.fullmatch(key):
            out[f"layers.{m.group(1)}.moe.router.gate.weight"] = tensor
        elif not key.endswith("rotary_emb.inv_freq"):
            ember_key = llama_hf.from_hf_key(key)
            out[ember_key] = llama_hf.tensor_from_hf(ember_key, tensor, args)  # type: ignore[arg-type]
    for (layer, name), per_expert in experts.items():
        if sorted(per_expert) != list(range(args.n_experts)):
            raise KeyError(f"layer {layer} {name}: experts {sorted(per_expert)} of {args.n_experts}")
        out[f"layers.{layer}.moe.experts.{name}"] = torch.stack([per_expert[e] for e in range(args.n_experts)])
    return out


def to_hf_state_dict(state: dict[str, torch.Tensor], args: MixtralArgs) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        parts = key.split(".")
        if ".moe.experts." in key:  # layers.{i}.moe.experts.w1 -> one matrix per expert (views, no copy)
            for e in range(args.n_experts):
                out[f"model.layers.{parts[1]}.block_sparse_moe.experts.{e}.{parts[-1]}.weight"] = tensor[e]
        elif ".moe.router.gate." in key:
            out[f"model.layers.{parts[1]}.block_sparse_moe.gate.weight"] = tensor
        else:
            out[llama_hf.to_hf_key(key)] = llama_hf.tensor_to_hf(key, tensor, args)  # type: ignore[arg-type]
    return out
