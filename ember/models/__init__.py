"""Model families: MODELS maps a `model.family` to what the trainer needs. A plain dict."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

from ember.models import llama
from ember.models.llama import hf as llama_hf


@dataclass(frozen=True)
class ModelSpec:
    family: str
    flavors: dict[str, Any]  # flavor name -> args dataclass
    model_cls: type
    parallelize: Callable
    flops_per_token: Callable[[Any, int], float]
    hf: ModuleType  # key mapping to and from Hugging Face checkpoints


MODELS: dict[str, ModelSpec] = {
    family: ModelSpec(family, flavors, llama.Transformer, llama.parallelize, llama.flops_per_token, llama_hf)
    for family, flavors in llama.FLAVORS.items()
}


def build_model_args(family: str, flavor: str, overrides: dict[str, Any] | None = None) -> Any:
    """The flavor's hyper-parameters with the user's `model.<field>` overrides applied."""
    if family not in MODELS:
        raise ValueError(f"unknown model.family '{family}' (choose from {', '.join(MODELS)})")
    flavors = MODELS[family].flavors
    if flavor not in flavors:
        raise ValueError(f"unknown model.flavor '{flavor}' for family '{family}' (choose from {', '.join(flavors)})")
    args = flavors[flavor]
    fields = {f.name for f in dataclasses.fields(args)}
    unknown = sorted(set(overrides or {}) - fields)
    if unknown:
        raise ValueError(f"model.{unknown[0]} is not a hyper-parameter of {family} (fields: {', '.join(sorted(fields))})")
    args = dataclasses.replace(args, **(overrides or {}))
    if args.dim % args.n_heads or args.n_heads % args.kv_heads:
        raise ValueError(
            f"model.dim={args.dim} must divide by model.n_heads={args.n_heads}, and n_heads by "
            f"model.n_kv_heads={args.kv_heads}"
        )
    return args
