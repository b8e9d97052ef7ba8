"""Hugging Face GPT2LMHeadModel (model_type "gpt2") <-> ember: config fields and state-dict keys.

GPT-2's linear layers are `Conv1D` modules whose weight is stored (in, out), the transpose of
nn.Linear's (out, in), so every matrix is transposed on the way in and out. Its attention projects
q, k and v with one fused `c_attn` (in, 3 dim), columns in q, k, v order; ember keeps three
projections (tensor parallelism splits each by heads) and splits / concatenates it here. The hub's
original GPT-2 files name weights without the `transformer.` prefix and carry `attn.bias` /
`attn.masked_bias` causal-mask buffers; both forms are read, save_pretrained's is written.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ember.models.gpt.args import GPTArgs

# ember key inside a layer -> GPT-2 key inside "transformer.h.{i}.", for the tensors that map one to one.
# Conv1D weights among them are transposed; c_attn (q, k, v) is handled apart.
_LAYER_KEYS = {
    "attention_norm.weight": "ln_1.weight",
    "attention_norm.bias": "ln_1.bias",
    "attention.wo.weight": "attn.c_proj.weight",
    "attention.wo.bias": "attn.c_proj.bias",
    "ffn_norm.weight": "ln_2.weight",
    "ffn_norm.bias": "ln_2.bias",
    "feed_forward.w1.weight": "mlp.c_fc.weight",
    "feed_forward.w1.bias": "mlp.c_fc.bias",
    "feed_forward.w2.weight": "mlp.c_proj.weight",
    "feed_forward.w2.bias": "mlp.c_proj.bias",
}
_TOP_KEYS = {
    "tok_embeddings.weight": "transformer.wte.weight",
    "pos_embeddings.weight": "transformer.wpe.weight",
    "norm.weight": "transformer.ln_f.weight",
    "norm.bias": "transformer.ln_f.bias",
    "output.weight": "lm_head.weight",
}
_LAYER_KEYS_FROM_HF = {v: k for k, v in _LAYER_KEYS.items()}
_TOP_KEYS_FROM_HF = {v: k for k, v in _TOP_KEYS.items()}
_QKV = ("attention.wq", "attention.wk", "attention.wv")
_LAYER = re.compile(r"transformer\.h\.(\d+)\.(.+)")
_MASK_BUFFER = re.compile(r"transformer\.h\.\d+\.attn\.(bias|masked_bias)")  # old causal-mask buffers


def family_of(args: GPTArgs) -> str:
    return "gpt"  # one family per args class


def _canonical(key: str) -> str:
    # The hub's original GPT-2 checkpoints have no "transformer." prefix (HF adds it on load).
    return key if key.startswith(("transformer.", "lm_head.")) else f"transformer.{key}"


def _is_conv1d_weight(hf_rest: str) -> bool:
    return hf_rest.startswith(("attn.c_", "mlp.c_")) and hf_rest.endswith(".weight")


def from_hf_state_dict(state_dict: dict[str, torch.Tensor], args: GPTArgs) -> dict[str, torch.Tensor]:
    """HF -> ember; with tied embeddings output.weight is the embedding tensor itself. KeyError names a
    key GPT2LMHeadModel does not have."""
    out: dict[str, torch.Tensor] = {}
    for raw_key, tensor in state_dict.items():
        key = _canonical(raw_key)
        if _MASK_BUFFER.fullmatch(key) or (args.tie_embeddings and key == "lm_head.weight"):
            continue
        if key in _TOP_KEYS_FROM_HF:
            out[_TOP_KEYS_FROM_HF[key]] = tensor
            continue
        m = _LAYER.fullmatch(key)
        if m is None:
            raise KeyError(f"'{raw_key}' is not a weight of GPT2LMHeadModel")
        layer, rest = m.group(1), m.group(2)
        if rest == "attn.c_attn.weight":  # (dim, 3 dim): columns q | k | v -> three (dim, dim) Linear weights
            for name, part in zip(_QKV, tensor.t().chunk(3, dim=0)):
                out[f"layers.{layer}.{name}.weight"] = part.contiguous()
        elif rest == "attn.c_attn.bias":  # (3 dim,)
            for name, part in zip(_QKV, tensor.chunk(3)):
                out[f"layers.{layer}.{name}.bias"] = part.contiguous()
        elif rest in _LAYER_KEYS_FROM_HF:
            weight = tensor.t().contiguous() if _is_conv1d_weight(rest) else tensor  # Conv1D (in, out) -> (out, in)
            out[f"layers.{layer}.{_LAYER_KEYS_FROM_HF[rest]}"] = weight
        else:
            raise KeyError(f"'{raw_key}' is not a weight of GPT2LMHeadModel")
    if args.tie_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def to_hf_state_dict(state_dict: dict[str, torch.Tensor], args: GPTArgs) -> dict[str, torch.Tensor]:
    """ember -> HF, as save_pretrained writes it (a tied lm_head is not stored; Conv1D weights (in, out))."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        if key in _TOP_KEYS:
            if not (args.tie_embeddings and key == "output.weight"):
                out[_TOP_KEYS[key]] = tensor
            continue
        _, layer, rest = key.split(".", 2)  # "layers.{i}.{rest}"
        prefix = f"transformer.h.{layer}."
        if rest in _LAYER_KEYS:
            hf_rest = _LAYER_KEYS[rest]
            out[prefix + hf_rest] = tensor.t() if _is_conv1d_weight(hf_rest) else tensor
        elif rest in ("attention.wq.weight", "attention.wq.bias"):  # fuse q, k, v when q's turn comes
            kind = rest.rsplit(".", 1)[1]
            parts = [state_dict[f"layers.{layer}.{name}.{kind}"] for name in _QKV]
            fused = torch.cat(parts, dim=0)  # (3 dim, dim) or (3 dim,)
            out[prefix + f"attn.c_attn.{kind}"] = fused.t() if kind == "weight" else fused
        elif not rest.startswith(("attention.wk.", "attention.wv.")):
            raise KeyError(f"'{key}' is not a weight of ember's GPT")
    return out


def args_from_hf_config(config: dict[str, Any]) -> GPTArgs:
    """GPTArgs for a HF GPT2LMHeadModel config.json; ValueError for what ember's GPT cannot express."""
    activation = config.get("activation_function", "gelu_new")
    if activation not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"activation_function='{activation}' is not supported (ember's GPT uses GELU's tanh "
                         f"approximation: gelu_new or gelu_pytorch_tanh)")
    if not config.get("scale_attn_weights", True) or config.get("scale_attn_by_inverse_layer_idx", False):
        raise ValueError("attention scaled other than by 1/sqrt(head_dim) is not supported "
                         "(scale_attn_weights=true, scale_attn_by_inverse_layer_idx=false)")
    if config.get("add_cross_attention", False):
        raise ValueError("add_cross_attention=true is not supported (ember's GPT is a decoder only)")
    missing = [key for key in ("n_embd", "n_layer", "n_head", "vocab_size") if key not in config]
    if missing:
        raise ValueError(f"no {', '.join(missing)} (a GPT2LMHeadModel config.json states them)")
    dim = config["n_embd"]
    return GPTArgs(
        dim=dim,
        n_layers=config["n_layer"],
        n_heads=config["n_head"],
        vocab_size=config["vocab_size"],
        ffn_hidden_dim=config.get("n_inner") or 4 * dim,  # None: GPT2Config's 4 x n_embd
        max_seq_len=config.get("n_positions", 1024),
        norm_eps=config.get("layer_norm_epsilon", 1e-5),
        tie_embeddings=bool(config.get("tie_word_embeddings", True)),
        init_std=config.get("initializer_range", 0.02),
    )


def hf_config_from_args(args: GPTArgs) -> dict[str, Any]:
    """A config.json for GPT2LMHeadModel (also `transformers.GPT2Config(**it)`)."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_embd": args.dim,
        "n_layer": args.n_layers,
        "n_head": args.n_heads,
        "n_inner": args.ffn_hidden_dim,
        "vocab_size": args.vocab_size,
        "n_positions": args.max_seq_len,
        "layer_norm_epsilon": args.norm_eps,
        "activation_function": "gelu_new",
        "tie_word_embeddings": args.tie_embeddings,
        "initializer_range": args.init_std,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        # ember trains without dropout; GPT2Config's default is 0.1 for each
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        # GPT2Config's default 50256 is GPT-2's <|endoftext|>; ember does not know this model's tokenizer
        "bos_token_id": None,
        "eos_token_id": None,
    }
