"""Hugging Face Gemma3ForCausalLM (model_type gemma3_text) and Gemma2ForCausalLM <-> ember: config fields and
state-dict keys. The hub's Gemma 3 4B-27B checkpoints (Gemma3ForConditionalGeneration, model_type gemma3) are read as
their text model: ember/model_io/hf_directory.py hands this module their text_config and text weights.

Names are Llama's (ember/models/llama/hf.py) for the projections, plus Gemma's four block norms and the q/k
norms. The q/k rows are permuted between RoPE conventions as Llama's, and the q/k norm weights, which run over
one head's width before RoPE, with them (permuted as a single head). The norms' weights are stored as the offset
from one on both sides.
"""

from __future__ import annotations

from typing import Any

import torch

from ember.models.gemma.args import GemmaArgs
from ember.models.llama import hf as llama_hf

_LAYER_KEYS = {  # ember key inside a layer -> HF key inside "model.layers.{i}."
    "attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight", "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight", "post_ffn_norm.weight": "post_feedforward_layernorm.weight",
}
_LAYER_KEYS_FROM_HF = {v: k for k, v in _LAYER_KEYS.items()}
# Gemma3TextConfig's defaults for what ember reads without a default of its own: the hub's multimodal configs were
# written by transformers 4.x, whose text_config holds only what differs from them (4B's has no head count at all)
_GEMMA3_TEXT_DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                         "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256}


def family_of(args: GemmaArgs) -> str:
    """gemma3 (q/k norms) or gemma2 (none): the two families share the model class."""
    return "gemma3" if args.qk_norm else "gemma2"


def to_hf_key(key: str) -> str:
    if key in llama_hf._TOP_KEYS:
        return llama_hf._TOP_KEYS[key]
    _, index, rest = key.split(".", 2)
    return f"model.layers.{index}.{_LAYER_KEYS[rest]}"


def from_hf_key(key: str) -> str:
    if key in llama_hf._TOP_KEYS_FROM_HF:
        return llama_hf._TOP_KEYS_FROM_HF[key]
    parts = key.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _LAYER_KEYS_FROM_HF:
        return f"layers.{parts[2]}.{_LAYER_KEYS_FROM_HF[parts[3]]}"
    raise KeyError(f"'{key}' is not a weight of Gemma3ForCausalLM")


def tensor_to_hf(key: str, tensor: torch.Tensor, args: GemmaArgs) -> torch.Tensor:
    return llama_hf.permute_rope_rows(key, tensor, args, to_hf=True)


def tensor_from_hf(ember_key: str, tensor: torch.Tensor, args: GemmaArgs) -> torch.Tensor:
    return llama_hf.permute_rope_rows(ember_key, tensor, args, to_hf=False)


def to_hf_state_dict(state: dict[str, torch.Tensor], args: GemmaArgs) -> dict[str, torch.Tensor]:
    return {to_hf_key(k): tensor_to_hf(k, t, args) for k, t in state.items()
            if not (args.tie_embeddings and k == "output.weight")}


def from_hf_state_dict(state: dict[str, torch.Tensor], args: GemmaArgs) -> dict[str, torch.Tensor]:
    out = {}
    for key, tensor in state.items():
        if not llama_hf.skip_hf_key(key, args):  # type: ignore[arg-type]
            ember_key = from_hf_key(key)
            out[ember_key] = tensor_from_hf(ember_key, tensor, args)
    if args.tie_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def _rope(config: dict[str, Any], layer_type: str, legacy_theta: str, default: float) -> dict[str, Any]:
    # transformers 5: rope_parameters per layer type; the hub's configs: rope_theta, rope_local_base_freq and a
    # rope_scaling for the global layers
    params = dict((config.get("rope_parameters") or {}).get(layer_type) or {})
    if layer_type == "full_attention" and not params and config.get("rope_scaling"):
        params = dict(config["rope_scaling"])
    params.setdefault("rope_theta", config.get(legacy_theta, default))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def args_from_hf_config(config: dict[str, Any]) -> GemmaArgs:
    """GemmaArgs for a Gemma 3 text config.json (a multimodal one's text_config) or a Gemma 2 one; ValueError for
    what ember's Gemma cannot express."""
    if config.get("model_type") == "gemma3_text":
        config = {**_GEMMA3_TEXT_DEFAULTS, **config}
    n = config["num_hidden_layers"]
    every = config.get("sliding_window_pattern", 6)
    layer_types = config.get("layer_types") or [
        "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]
    globals_at = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
    every = globals_at[0] + 1 if globals_at else n + 1
    if layer_types != ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]:
        raise ValueError(f"layer_types {layer_types} are not one global layer every {every}, which is all ember's "
                         "Gemma 3 expresses")
    gemma2 = config.get("model_type") == "gemma2"
    if config.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=true is not a causal language model")
    if config.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation='{config['hidden_activation']}' is not supported (GeGLU with tanh GELU)")
    if gemma2:  # one RoPE for every layer
        global_rope = local_rope = llama_hf._rope_parameters(config)
    else:
        global_rope = _rope(config, "full_attention", "rope_theta", 1_000_000.0)
        local_rope = _rope(config, "sliding_attention", "rope_local_base_freq", 10_000.0)
    if global_rope["rope_type"] not in ("default", "linear") or local_rope["rope_type"] != "default":
        raise ValueError(f"RoPE types {global_rope['rope_type']} (global) and {local_rope['rope_type']} (local) "
                         "are not supported (ember implements default and linear for the global layers, "
                         "default for the local)")
    return GemmaArgs(
        dim=config["hidden_size"], n_layers=n, n_heads=config["num_attention_heads"],
        n_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"], vocab_size=config["vocab_size"],
        ffn_hidden_dim=config["intermediate_size"], head_dim_override=llama_hf.explicit_head_dim(config),
        norm_eps=config.get("rms_norm_eps", 1e-6), query_pre_attn_scalar=int(config.get("query_pre_attn_scalar", 256)),
        sliding_window=config.get("sliding_window", 4096), global_every=every,
        rope_theta=float(global_rope["rope_theta"]),
        rope_linear_factor=float(global_rope["factor"]) if global_rope["rope_type"] == "linear" else None,
        local_rope_theta=None if gemma2 else float(local_rope["rope_theta"]),
        max_seq_len=config.get("max_position_embeddings", 131072),
        tie_embeddings=bool(config.get("tie_word_embeddings", True)), qk_norm=not gemma2,
        attn_softcap=config.get("attn_logit_softcapping"), final_softcap=config.get("final_logit_softcapping"),
    )


def hf_config_from_args(args: GemmaArgs) -> dict[str, Any]:
    """A config.json that transformers' Gemma3ForCausalLM (Gemma2ForCausalLM) loads as this model; ValueError for
    a mix of the two that neither class has."""
    global_rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_linear_factor is not None:
        global_rope.update(rope_type="linear", factor=args.rope_linear_factor)
    gemma2 = family_of(args) == "gemma2"
    if gemma2 and (args.local_rope_theta is not None or args.rope_linear_factor is not None):
        raise ValueError("Gemma 2 has one unscaled RoPE for every layer: a local base or linear scaling without q/k "
                         "norms has no Hugging Face form")
    rope_parameters = global_rope if gemma2 else {
        "full_attention": global_rope,
        "sliding_attention": {"rope_type": "default", "rope_theta": args.local_rope_theta}}
    return {
        "architectures": ["Gemma2ForCausalLM" if gemma2 else "Gemma3ForCausalLM"],
        "model_type": "gemma2" if gemma2 else "gemma3_text", "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim,
        "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps, "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings, "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": args.query_pre_attn_scalar, "sliding_window": args.sliding_window,
        "layer_types": ["sliding_attention" if args.layer_span(i) else "full_attention" for i in range(args.n_layers)],
        "rope_parameters": rope_parameters,
        "final_logit_softcapping": args.final_softcap, "attn_logit_softcapping": args.attn_softcap,
        # Gemma3TextConfig's defaults name tokens 0-2; the tokenizer exported beside the weights names its own
        "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
    }
