"""The hyper-parameter rules of every family, run wherever a model's args are made: a run's config
(`build_model_args`, before anything is written to output_dir) and a model description read from disk
(`model_meta.parse_model_meta`), so a checkpoint ember writes is one ember reads back.

Each args dataclass declares its own: an int field is a size or a count, >= 1 unless its default is 0 or the
class's AT_LEAST gives it another floor (a count that may be none: DeepSeek's shared experts, its dense layers);
`validate()`, where a class has one, checks the fields that must fit together. Each mistake is one ConfigError
naming the model.* key and a fix. No torch here: a model that cannot be built must not get that far."""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, Optional

from ember.errors import ConfigError


@functools.cache
def int_floors(args_cls: type) -> dict[str, int]:
    """Each int (or Optional[int]) field's least value: 0 where the default is 0, AT_LEAST's, else 1."""
    hints = typing.get_type_hints(args_cls)
    floors = getattr(args_cls, "AT_LEAST", {})
    return {f.name: floors.get(f.name, 0 if f.default == 0 else 1) for f in dataclasses.fields(args_cls)
            if hints[f.name] is int or int in typing.get_args(hints[f.name])}


def below_floor(args: Any) -> Optional[tuple[str, int, int]]:
    """(field, value, floor) of the first int field under its floor, None if every one is at or above it."""
    for name, floor in int_floors(type(args)).items():
        value = getattr(args, name)
        if isinstance(value, int) and not isinstance(value, bool) and value < floor:
            return name, value, floor
    return None


def config_key(args_cls: type, field: str) -> str:
    """The model.* key that sets a field (`head_dim` for head_dim_override)."""
    return {f: key for key, f in getattr(args_cls, "CONFIG_KEYS", {}).items()}.get(field, field)


def check_args(args: Any, flavor_args: Any = None) -> None:
    """Every rule `args` must keep (the floors, top_k within the experts, the class's validate()); ConfigError,
    one line. flavor_args: the flavor the user's keys changed, whose value the message offers to keep."""
    found = below_floor(args)
    if found:
        name, value, floor = found
        key = config_key(type(args), name)
        keep = getattr(flavor_args, name, None)
        flavor = f", or drop model.{key} (the flavor's is {keep})" if keep is not None else ""
        raise ConfigError(f"model.{key}={value} must be >= {floor} (a size or a count); set model.{key} to {floor} "
                          f"or more{flavor}")
    n_experts = getattr(args, "n_experts", 0)
    if n_experts and args.top_k > n_experts:
        raise ConfigError(f"model.top_k={args.top_k} must be at most model.n_experts={n_experts}")
    validate = getattr(args, "validate", None)
    if validate is not None:
        validate()


def require_expert_layers(args: Any, key: str, rule: str, choices: str) -> None:
    """A mixture of experts (n_experts > 0) whose layer rule gives no layer experts is a dense model in disguise:
    refused naming the key of that rule."""
    if args.n_experts and not any(map(args.is_moe_layer, range(args.n_layers))):
        raise ConfigError(f"model.{key}={getattr(args, key)} leaves none of the {args.n_layers} layers with experts "
                          f"({rule}); use {choices}")
