"""Hugging Face LlamaForCausalLM <-> ember: config fields and state-dict keys.

Meta's RoPE (and ember's) rotates consecutive pairs (2k, 2k+1) of each head; HF's `rotate_half` pairs
k with k + head_dim/2. The checkpoints hold the same model because the rows of wq and wk are permuted
to match: Meta's convert_llama_weights_to_hf applies `permute` on export. `to_hf` applies it here,
`from_hf` undoes it; no other weight changes.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ember.models.llama.args import LlamaArgs

# ember key inside a layer -> HF key inside "model.layers.{i}."
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
_TOP_KEYS = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_KEYS_FROM_HF = {v: k for k, v in _LAYER_KEYS.items()}
_TOP_KEYS_FROM_HF = {v: k for k, v in _TOP_KEYS.items()}


def family_of(args: LlamaArgs) -> str:
    """The family a LlamaArgs is saved under: Llama 2 and 3.x share one architecture, and llama3 reads them all
    (config.json carries the differences)."""
    return "llama3"


def permute_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of wq/wk from pair order (k, j), row 2k + j of each head, to half order (j, k), row j * D/2 + k."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def permute_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of permute_to_hf."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def permute_rope_rows(key: str, tensor: torch.Tensor, args: Any, to_hf: bool) -> torch.Tensor:
    """Everything laid out along wq's and wk's rows between RoPE conventions: their weights and biases (Qwen2),
    and q/k norm weights, which run over one head's width before RoPE (Qwen3, Gemma 3: permuted as a single
    head). Other tensors are returned as they are."""
    permute = permute_to_hf if to_hf else permute_from_hf
    heads = {"attention.wq": args.n_heads, "attention.wk": args.kv_heads, "attention.q_norm": 1, "attention.k_norm": 1}
    for module, n_heads in heads.items():
        if f".{module}." in key:
            return permute(tensor, n_heads) if tensor.dim() == 2 else permute(tensor[:, None], n_heads)[:, 0]
    return tensor


def to_hf_key(key: str) -> str:
    if key in _TOP_KEYS:
        return _TOP_KEYS[key]
    _, index, rest = key.split(".", 2)  # "layers.{i}.{rest}"
    return f"model.layers.{index}.{_LAYER_KEYS[rest]}"


def from_hf_key(key: str) -> str:
    """The ember key of a HF weight name; KeyError for a name LlamaForCausalLM does not have."""
    if key in _TOP_KEYS_FROM_HF:
        return _TOP_KEYS_FROM_HF[key]
    parts = key.split(".", 3)  # "model", "layers", "{i}", rest
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _LAYER_KEYS_FROM_HF:
        return f"layers.{parts[2]}.{_LAYER_KEYS_FROM_HF[parts[3]]}"
    raise KeyError(f"'{key}' is not a weight of LlamaForCausalLM")


def tensor_to_hf(key: str, tensor: torch.Tensor, args: LlamaArgs) -> torch.Tensor:
    if key.endswith("attention.wq.weight"):
        return permute_to_hf(tensor, args.n_heads)
    if key.endswith("attention.wk.weight"):
        return permute_to_hf(tensor, args.kv_heads)
    return tensor


def tensor_from_hf(ember_key: str, tensor: torch.Tensor, args: LlamaArgs) -> torch.Tensor:
    if ember_key.endswith("attention.wq.weight"):
        return permute_from_hf(tensor, args.n_heads)
    if ember_key.endswith("attention.wk.weight"):
        return permute_from_hf(tensor, args.kv_heads)
    return tensor


def skip_hf_key(key: str, args: LlamaArgs) -> bool:
    """Entries of a HF state dict with no ember counterpart: a tied lm_head, old rotary buffers."""
    return key.endswith("rotary_emb.inv_freq") or (args.tie_embeddings and key == "lm_head.weight")


def to_hf_state_dict(state_dict: dict[str, torch.Tensor], args: LlamaArgs) -> dict[str, torch.Tensor]:
    """ember -> HF, as save_pretrained writes it (a tied lm_head is not stored)."""
    return {to_hf_key(k): tensor_to_hf(k, t, args) for k, t in state_dict.items()
            if not (args.tie_embeddings and k == "output.weight")}


def from_hf_state_dict(state_dict: dict[str, torch.Tensor], args: LlamaArgs) -> dict[str, torch.Tensor]:
    """HF -> ember; with tied embeddings output.weight is the embedding tensor itself."""
    out = {}
    for key, tensor in state_dict.items():
        if not skip_hf_key(key, args):
            ember_key = from_hf_key(key)
            out[ember_key] = tensor_from_hf(ember_key, tensor, args)
    if args.tie_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def _rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 writes `rope_parameters` (rope_theta inside); 4.x wrote `rope_theta` beside a
    # `rope_scaling` dict (or null), with the type under "rope_type" or, older still, "type".
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def explicit_head_dim(config: dict[str, Any]) -> Optional[int]:
    """config.json's head_dim where it is not hidden_size / num_attention_heads (None: the quotient)."""
    head_dim = config.get("head_dim")
    derived = config["hidden_size"] // config["num_attention_heads"]
    if head_dim is None or (head_dim == derived and config["hidden_size"] % config["num_attention_heads"] == 0):
        return None
    return int(head_dim)


def args_from_hf_config(config: dict[str, Any]) -> LlamaArgs:
    """LlamaArgs for a HF LlamaForCausalLM config.json; ValueError for what ember's Llama cannot express."""
    rope = _rope_parameters(config)
    if rope["rope_type"] not in ("default", "llama3"):
        raise ValueError(f"RoPE type '{rope['rope_type']}' is not supported (ember implements 'default' and 'llama3')")
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            raise ValueError(f"{flag}=true is not supported (ember's Llama has no biases)")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act='{config['hidden_act']}' is not supported (SwiGLU uses silu)")
    scaling = llama31_scaling_fields(rope)
    return LlamaArgs(
        dim=dim,
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        vocab_size=config["vocab_size"],
        ffn_hidden_dim_override=config["intermediate_size"],  # stated outright: no formula to invert
        head_dim_override=explicit_head_dim(config),
        norm_eps=config.get("rms_norm_eps", 1e-6),  # LlamaConfig's default
        rope_theta=float(rope["rope_theta"]),
        max_seq_len=config.get("max_position_embeddings", 2048),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        **scaling,
    )


def llama31_scaling_fields(rope: dict[str, Any]) -> dict[str, Any]:
    """The args fields of a config's Llama 3.1 RoPE scaling (rope_type "llama3"; Llama 3.1-3.2, Llama 4 Scout); {}
    for any other type."""
    if rope["rope_type"] != "llama3":
        return {}
    return dict(rope_scaling_factor=float(rope["factor"]), rope_low_freq_factor=float(rope["low_freq_factor"]),
                rope_high_freq_factor=float(rope["high_freq_factor"]),
                rope_original_max_seq_len=int(rope["original_max_position_embeddings"]))


def rope_parameters(args: Any) -> dict[str, Any]:
    """config.json's rope_parameters for args with rope_theta and, where set, Llama 3.1 scaling."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling_factor is not None:
        rope.update(rope_type="llama3", factor=args.rope_scaling_factor, low_freq_factor=args.rope_low_freq_factor,
                    high_freq_factor=args.rope_high_freq_factor,
                    original_max_position_embeddings=args.rope_original_max_seq_len)
    return rope


def hf_config_from_args(args: LlamaArgs) -> dict[str, Any]:
    """A config.json for LlamaForCausalLM (also `transformers.LlamaConfig(**it)`)."""
    rope = rope_parameters(args)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rope_parameters": rope,  # transformers 5
        # transformers 4.x reads these two instead (5.x accepts them beside rope_parameters)
        "rope_theta": args.rope_theta,
        "rope_scaling": ({k: v for k, v in rope.items() if k != "rope_theta"}
                         if args.rope_scaling_factor is not None else None),
    }
