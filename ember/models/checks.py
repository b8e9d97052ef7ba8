"""The hyper-parameter rules of every family, run wherever a model's args are made: a run's config
(`build_model_args`, before anything is written to output_dir) and a model description read from disk
(`model_meta.parse_model_meta`), so a checkpoint ember writes is one ember reads back.

Each args dataclass (a DecoderArgs, ember/nn/args.py) declares its own: an int field is a size or a count, >= 1
unless its default is 0 or the class's AT_LEAST gives it another floor (a count that may be none: DeepSeek's shared
experts, its dense layers); `validate()` checks the fields that must fit together, with the helpers below for the
rules several families share. Each mistake is one ConfigError naming the model.* key and a fix. No torch here: a
model that cannot be built must not get that far."""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from typing import Optional

from ember.errors import ConfigError
from ember.nn.args import DecoderArgs


@functools.cache
def int_floors(args_cls: type[DecoderArgs]) -> dict[str, int]:
    """Each int (or Optional[int]) field's least value: 0 where the default is 0, AT_LEAST's, else 1."""
    hints = typing.get_type_hints(args_cls)
    floors = args_cls.AT_LEAST
    return {f.name: floors.get(f.name, 0 if f.default == 0 else 1) for f in dataclasses.fields(args_cls)
            if hints[f.name] is int or int in typing.get_args(hints[f.name])}


def below_floor(args: DecoderArgs) -> Optional[tuple[str, int, int]]:
    """(field, value, floor) of the first int field under its floor, None if every one is at or above it."""
    values = dataclasses.asdict(args)
    for name, floor in int_floors(type(args)).items():
        value = values[name]
        if isinstance(value, int) and not isinstance(value, bool) and value < floor:
            return name, value, floor
    return None


def config_key(args_cls: type[DecoderArgs], field: str) -> str:
    """The model.* key that sets a field (`head_dim` for head_dim_override)."""
    return {f: key for key, f in args_cls.CONFIG_KEYS.items()}.get(field, field)


def check_args(args: DecoderArgs, flavor_args: Optional[DecoderArgs] = None) -> None:
    """Every rule `args` must keep (the floors, then the class's validate()); ConfigError, one line. flavor_args:
    the flavor the user's keys changed, whose value the message offers to keep."""
    found = below_floor(args)
    if found:
        name, value, floor = found
        key = config_key(type(args), name)
        keep = dataclasses.asdict(flavor_args).get(name) if flavor_args is not None else None
        flavor = f", or drop model.{key} (the flavor's is {keep})" if keep is not None else ""
        raise ConfigError(f"model.{key}={value} must be >= {floor} (a size or a count); set model.{key} to {floor} "
                          f"or more{flavor}")
    args.validate()


def check_top_k(n_experts: int, top_k: int) -> None:
    """A mixture of experts routes each token to top_k of its n_experts (0 experts: a dense model, no rule)."""
    if n_experts and top_k > n_experts:
        raise ConfigError(f"model.top_k={top_k} must be at most model.n_experts={n_experts}")


def require_expert_layers(args: DecoderArgs, n_experts: int, key: str, value: int, rule: str, choices: str) -> None:
    """A mixture of experts (n_experts > 0) whose layer rule gives no layer experts is a dense model in disguise:
    refused naming the key of that rule (`key`, set to `value`)."""
    if n_experts and not any(map(args.is_moe_layer, range(args.n_layers))):
        raise ConfigError(f"model.{key}={value} leaves none of the {args.n_layers} layers with experts "
                          f"({rule}); use {choices}")


def check_non_negative(key: str, value: Optional[float]) -> None:
    """A scale that may be 0 but must be a number (Llama 4's temperature slope, DeepSeek's routed_scaling_factor)."""
    if value is not None and not (math.isfinite(value) and value >= 0):
        raise ConfigError(f"model.{key}={value} must be a finite number >= 0")


def no_llama3_scaling(value: Optional[float]) -> None:
    """`rope_scaling_factor` is in every RoPE family's args (model.json files store it, null) but only Llama's and
    Llama 4's RoPE has Llama 3.1's scaling; elsewhere a value would be ignored, so it is refused."""
    if value is not None:
        raise ConfigError(f"rope_scaling_factor={value} is Llama 3.1's RoPE scaling, which this family's RoPE does "
                          "not have; set it to null")
