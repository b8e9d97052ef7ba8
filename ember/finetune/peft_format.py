"""LoRA adapters in peft's format: `adapter_config.json` + `adapter_model.safetensors`.

What `peft.PeftModel.from_pretrained(base, DIR)` reads (peft 0.21): keys `base_model.model.<HF module>.lora_A.weight`
(r, in) and `.lora_B.weight` (out, r), without the adapter name, and a config with peft_type LORA, task_type
CAUSAL_LM, r, lora_alpha, target_modules, lora_dropout and bias "none". The HF module names come from the
family's hf.py, and so do the row permutations: Llama's q/k rows are reordered between RoPE conventions
(W_hf = P W), and P (B A) = (P B) A, so B's rows are permuted exactly like the base weight's and A is kept.
GPT-2 fuses q, k and v into one `c_attn` (a Conv1D, hence fan_in_fan_out): the three adapters become one of
rank 3r, A stacked and B block-diagonal, with rank_pattern/alpha_pattern keeping the scaling alpha/r. In the MoE
families whose experts transformers 5 fuses, the layers whose names peft re-aims at those experts are targeted by
their weights (`target_parameters`), the same keys holding their adapters (_PEFT_EXPERT_NAMES).

A peft adapter directory is also a model to ember (load_model, model.init_from): its base
(`base_model_name_or_path`, a local HF or ember directory; a relative path is read from the adapter's
directory) with the adapter folded into the weights.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import ModuleType
from typing import Any, Union

import torch
from torch import nn

from ember.errors import CheckpointError, UserFileNotFound

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
# ember module inside a GPT block -> GPT-2's (c_attn is the fused q, k, v and is handled apart)
_GPT_MODULES = {"attention.wo": "attn.c_proj", "feed_forward.w1": "mlp.c_fc", "feed_forward.w2": "mlp.c_proj"}
_QKV = ("attention.wq", "attention.wk", "attention.wv")
# The target names peft (0.21, with transformers 5) re-aims at the fused experts of these model types, whose experts
# transformers 5 stacks into `mlp.experts.gate_up_proj` / `down_proj` parameters (peft/utils/
# transformers_weight_conversion.py, _MOE_TARGET_MODULE_MAPPING): a target_modules entry ending in one, even a full
# module name, adapts every MoE layer's experts or router and leaves the dense layer or shared expert of that name
# without its adapter. Those layers are named by their weight in target_parameters instead, which peft applies to
# exactly that parameter (W + alpha/r B A, as a target module would).
_QWEN2_MOE_NAMES = ("gate", "gate_proj", "up_proj", "down_proj")
_PEFT_EXPERT_NAMES = {"mixtral": ("gate", "w1", "w2", "w3"), "qwen3_moe": _QWEN2_MOE_NAMES,
                      "deepseek_v2": _QWEN2_MOE_NAMES, "deepseek_v3": _QWEN2_MOE_NAMES}


def is_peft_dir(path: Path) -> bool:
    return (path / ADAPTER_CONFIG).is_file()


def _hf_style(family: str) -> str:
    """'llama' (the families whose linear layers carry llama/hf.py's names: Llama, Mixtral, Mistral, Qwen, Gemma,
    Llama 4, DeepSeek) or 'gpt'; GLaM has no HF format."""
    from ember.models import MODELS, deepseek, gemma, llama, llama4, mistral, mixtral, qwen

    if MODELS[family].hf in (llama.hf, mixtral.hf, mistral.hf, qwen.hf, gemma.hf, llama4.hf, deepseek.hf):
        return "llama"
    if family == "gpt":
        return "gpt"
    if family == "phi3":
        raise CheckpointError("a peft adapter for Phi-3's fused qkv_proj and gate_up_proj is not supported yet; export "
                              "the LoRA run merged into its base with --to hf")
    raise CheckpointError(f"the {family} family has no Hugging Face format, so no peft adapter either; keep the "
                          "ember checkpoint")


def _key_mapping(family: str) -> ModuleType:
    """The hf module whose to_hf_key/from_hf_key and RoPE row permutation name and lay out the family's linears: its
    own, or Llama's where it has none of its own (Mixtral: the same attention names)."""
    from ember.models import MODELS

    hf = MODELS[family].hf
    return hf if hasattr(hf, "to_hf_key") else MODELS["llama3"].hf


# ---- export ---------------------------------------------------------------------------------------------


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' save_file, with the file readable as the directory's other files are (0644 under the usual
    umask): safetensors creates it 0600, so a shared model directory had unreadable weights beside its config."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})
    umask = os.umask(0)  # the only way to read it; set straight back
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def save_peft(meta: dict[str, Any], args: Any, state: dict[str, torch.Tensor], out_dir: Union[str, Path]) -> None:
    """Write a LoRA checkpoint's adapters (`state`: ember name -> tensor; `meta`: its model.json) as a peft
    adapter directory."""
    settings = meta["lora"]
    if settings.get("train_embeddings") or settings.get("train_norms"):
        raise CheckpointError("this LoRA run also trained embeddings or norms (lora.train_*), which a peft adapter "
                              "would carry as modules_to_save: not exported yet; use --to hf (merged) instead")
    style = _hf_style(meta["family"])
    names = sorted({n.rsplit(".lora_", 1)[0] for n in state})  # layers.{i}.attention.wq, ...
    tensors: dict[str, torch.Tensor] = {}
    config: dict[str, Any] = {}
    if style == "llama":
        hf = _key_mapping(meta["family"])
        modules = [_hf_module(hf, name) for name in names]
        for name, module in zip(names, modules):
            tensors[f"{PREFIX}{module}.lora_A.weight"] = state[f"{name}.lora_A.weight"]
            tensors[f"{PREFIX}{module}.lora_B.weight"] = hf.tensor_to_hf(f"{name}.weight",
                                                                         state[f"{name}.lora_B.weight"], args)
        claimed = _PEFT_EXPERT_NAMES.get(meta["family"], ())
        by_weight = sorted(m for m in modules if m.rsplit(".", 1)[1] in claimed)
        targets = _target_modules(meta["family"], args, hf, [m for m in modules if m not in by_weight])
        if by_weight:
            # peft's ParamWrapper (what target_parameters makes) refuses dropout; dropout acts only in training, so the
            # adapter's function is the same without it
            config.update(target_parameters=[f"{m}.weight" for m in by_weight], lora_dropout=0.0)
    else:
        targets, pattern = _gpt_adapters(names, state, settings, tensors)
        config.update(fan_in_fan_out=True, **pattern)
    base = meta.get("base")
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": settings["rank"], "lora_alpha": settings["alpha"],
              "target_modules": targets, "lora_dropout": settings["dropout"], "bias": "none",
              "base_model_name_or_path": base, "inference_mode": True, **config}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_safetensors({k: v.contiguous() for k, v in tensors.items()}, out_dir / ADAPTER_WEIGHTS)
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def _hf_module(hf: ModuleType, name: str) -> str:
    """The HF module name of the ember linear `name` (layers.0.attention.wq -> model.layers.0.self_attn.q_proj)."""
    try:
        return hf.to_hf_key(f"{name}.weight").removesuffix(".weight")
    except KeyError:  # Mixtral's router: its HF name is not one ember's peft mapping writes or reads
        raise CheckpointError(f"the adapter on {name} has no Hugging Face module name that ember writes for peft; "
                              "export the LoRA run merged into its base with --merge") from None


def _target_modules(family: str, args: Any, hf: ModuleType, adapted: list[str]) -> list[str]:
    """peft's target_modules for the HF modules ember adapted: their last names (q_proj, ...) where those name
    exactly them, else their full names. peft takes a module whose name ends in a target's, so Llama 4's gate_proj
    would also wrap each MoE layer's shared_expert.gate_proj, which ember did not adapt (peft then warns of missing
    adapter keys and runs that module with a random-A, zero-B adapter of its own)."""
    from ember.models import MODELS

    with torch.device("meta"):  # shapes only: the base's linear layers by name
        model = MODELS[family].model_cls(args)
    others = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.startswith("layers."):
            try:
                others.add(hf.to_hf_key(f"{name}.weight").removesuffix(".weight"))
            except KeyError:  # no HF name of its own (Mixtral's router): no peft target either
                continue
    leaves = {name.rsplit(".", 1)[1] for name in adapted}
    exact = not any(other.rsplit(".", 1)[1] in leaves for other in others - set(adapted))
    return sorted(leaves) if exact else sorted(adapted)


def _gpt_adapters(names: list[str], state: dict[str, torch.Tensor], settings: dict[str, Any],
                  tensors: dict[str, torch.Tensor]) -> tuple[list[str], dict[str, Any]]:
    """GPT-2's module names; q/k/v adapters fused into one c_attn adapter of rank 3r (absent ones zero)."""
    r, targets = settings["rank"], set()
    layers = sorted({n.split(".")[1] for n in names}, key=int)
    for layer in layers:
        prefix = f"{PREFIX}transformer.h.{layer}."
        for ember, hf_name in _GPT_MODULES.items():
            name = f"layers.{layer}.{ember}"
            if name in names:
                tensors[prefix + hf_name + ".lora_A.weight"] = state[f"{name}.lora_A.weight"]
                tensors[prefix + hf_name + ".lora_B.weight"] = state[f"{name}.lora_B.weight"]
                targets.add(hf_name)
        qkv = [f"layers.{layer}.{m}" for m in _QKV]
        if any(n in names for n in qkv):
            dim = next(state[f"{n}.lora_B.weight"].shape[0] for n in qkv if n in names)
            a_parts, b = [], torch.zeros(3 * dim, 3 * r)
            for i, n in enumerate(qkv):
                if n in names:
                    a_parts.append(state[f"{n}.lora_A.weight"])
                    b[i * dim:(i + 1) * dim, i * r:(i + 1) * r] = state[f"{n}.lora_B.weight"]
                else:
                    a_parts.append(torch.zeros(
                        r, state[f"{next(x for x in qkv if x in names)}.lora_A.weight"].shape[1]))
            tensors[prefix + "attn.c_attn.lora_A.weight"] = torch.cat(a_parts)  # (3r, dim)
            tensors[prefix + "attn.c_attn.lora_B.weight"] = b  # (3 dim, 3r), block-diagonal
            targets.add("c_attn")
    # c_attn's rank is 3r: its alpha is 3 alpha so that the scaling stays alpha / r.
    pattern = ({"rank_pattern": {"c_attn": 3 * r}, "alpha_pattern": {"c_attn": 3 * settings["alpha"]}}
               if "c_attn" in targets else {})
    return sorted(targets), pattern


# ---- import: a peft directory folded into its base -------------------------------------------------------


def check_adapter_config(config: dict[str, Any], adapter_dir: Path) -> dict[str, Any]:
    """An adapter_config.json's contents, refused with one line where ember cannot apply it."""
    unsupported = [(k, v) for k, v in (("peft_type", config.get("peft_type")),) if v != "LORA"]
    for key in ("use_dora", "modules_to_save", "layers_to_transform"):
        if config.get(key):
            unsupported.append((key, config[key]))
    if config.get("bias", "none") != "none":
        unsupported.append(("bias", config["bias"]))
    if unsupported:
        key, value = unsupported[0]
        raise CheckpointError(f"'{adapter_dir / ADAPTER_CONFIG}': {key}={value!r} is not supported (ember reads plain "
                              "LoRA adapters: peft_type LORA, bias none, no DoRA or modules_to_save)")
    return config


def peft_base(config: dict[str, Any], adapter_dir: Path) -> Path:
    """The base model directory an adapter names (base_model_name_or_path), which must be local."""
    base = config.get("base_model_name_or_path")
    candidates = [Path(base).expanduser(), adapter_dir / base] if isinstance(base, str) and base else []
    for path in candidates:
        if path.is_dir():
            return path
    raise UserFileNotFound(f"'{adapter_dir / ADAPTER_CONFIG}': base_model_name_or_path {base!r} is not a local "
                           "directory; set it to the base model's HF or ember directory (ember reads no hub models)")


@torch.no_grad()
def merge_peft_adapter(model: nn.Module, family: str, config: dict[str, Any], adapter_dir: Path) -> None:
    """Fold a peft LoRA adapter into `model`'s (plain) weights: W += scaling * B A, mapped to ember's layout.
    An adapter made for another base (a module it lacks, other shapes) is a one-line CheckpointError."""
    from safetensors.torch import load_file

    check_adapter_config(config, adapter_dir)
    weights = adapter_dir / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise UserFileNotFound(f"'{weights}' is missing (a peft adapter directory holds {ADAPTER_WEIGHTS})")
    state = load_file(str(weights))
    style = _hf_style(family)
    hf = _key_mapping(family)
    modules = sorted({k.rsplit(".lora_", 1)[0] for k in state if ".lora_A." in k or ".lora_B." in k})
    if not modules:
        raise CheckpointError(f"'{weights}' holds no lora_A/lora_B tensors")
    for module in modules:
        hf_module = module.removeprefix(PREFIX)
        a, b = state.get(f"{module}.lora_A.weight"), state.get(f"{module}.lora_B.weight")
        if a is None or b is None:
            raise CheckpointError(f"'{weights}': {hf_module} has only one of lora_A and lora_B")
        leaf = hf_module.rsplit(".", 1)[-1]
        r = config.get("rank_pattern", {}).get(leaf, config.get("r", a.shape[0]))
        alpha = config.get("alpha_pattern", {}).get(leaf, config.get("lora_alpha", r))
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        delta = (b.float() @ a.float()) * scaling  # (out, in) in Linear terms; peft transposes for Conv1D itself
        try:
            if style == "llama":
                ember_key = hf.from_hf_key(f"{hf_module}.weight")
                parts = {ember_key: hf.tensor_from_hf(ember_key, delta, model.args)}
            else:
                parts = _gpt_delta(hf_module, delta)
        except KeyError:
            raise CheckpointError(f"'{adapter_dir}' adapts {hf_module}, which this {family} base does not have: an "
                                  "adapter for another base") from None
        params = dict(model.named_parameters())
        for key, part in parts.items():
            target = params.get(key)
            if target is None or tuple(target.shape) != tuple(part.shape):
                have = tuple(target.shape) if target is not None else "nothing"
                raise CheckpointError(f"'{adapter_dir}': {hf_module} gives a {tuple(part.shape)} update "
                                      f"but the base has {have} for {key}: an adapter for another base")
            target.copy_((target.float() + part).to(target.dtype))


def _gpt_delta(hf_module: str, delta: torch.Tensor) -> dict[str, torch.Tensor]:
    parts = hf_module.split(".")  # transformer.h.{i}.attn.c_attn
    if len(parts) != 5 or parts[:2] != ["transformer", "h"]:
        raise KeyError(hf_module)
    layer, rest = parts[2], ".".join(parts[3:])
    if rest == "attn.c_attn":
        return {f"layers.{layer}.{m}.weight": d for m, d in zip(_QKV, delta.chunk(3, dim=0))}
    ember = {v: k for k, v in _GPT_MODULES.items()}.get(rest)
    if ember is None:
        raise KeyError(hf_module)
    return {f"layers.{layer}.{ember}.weight": delta}
