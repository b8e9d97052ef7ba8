"""model.json: the model description {"family", "flavor", "args"} every ember checkpoint carries (and `ember
convert --to torch` files embed), enough to rebuild the model without its recipe; reading it checks every key
against the family's hyper-parameter dataclass, so a bad file is one CheckpointError naming the key."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Optional, Union

import torch

from ember.config_schema import ModelConfig
from ember.errors import CheckpointError, UserFileNotFound, first_error_line
from ember.models import MODELS, checks
from ember.nn.args import DecoderArgs
from ember.nn.decoder import Decoder

MODEL_JSON = "model.json"


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a file ember reads (model.json, config.json, adapter_config.json); anything else is
    one CheckpointError naming the file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"'{path}' is not readable JSON ({err})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"'{path}' does not hold a JSON object")
    return data


def parse_model_meta(meta: Any, where: Union[str, Path]) -> tuple[str, str, DecoderArgs]:
    """(family, flavor, args dataclass) of a model description read from disk ({"family", "flavor", "args"},
    as `checkpoint.meta_for` writes it into model.json and `ember convert --to torch` into a torch file).

    Every key is checked against the family's args dataclass: an unknown family, an unknown, missing or
    mistyped hyper-parameter, a size below 1, or sizes that do not fit together is one CheckpointError naming
    the file and the key (it used to surface as a KeyError/TypeError traceback from deep inside a model)."""
    if not isinstance(meta, dict) or not isinstance(meta.get("args"), dict):
        raise CheckpointError(f"'{where}' has no model description {{family, flavor, args}}; "
                              "write it with ember train or ember convert")
    family, flavor = meta.get("family"), meta.get("flavor", "custom")
    if not isinstance(family, str) or family not in MODELS:
        raise CheckpointError(f"'{where}' names model family {family!r}, which ember does not know "
                              f"(known: {', '.join(MODELS)})")
    if not isinstance(flavor, str):
        raise CheckpointError(f"'{where}': flavor {flavor!r} is not a name (a string)")
    args_cls = MODELS[family].args_cls
    fields = {f.name: f for f in dataclasses.fields(args_cls)}
    hints = typing.get_type_hints(args_cls)
    floors = checks.int_floors(args_cls)  # the floors a run's config is held to (models/checks.py)
    given = meta["args"]
    unknown = sorted(set(given) - set(fields))
    if unknown:
        raise CheckpointError(f"'{where}': '{unknown[0]}' is not a hyper-parameter of {family} "
                              f"(a file from another ember version or family?)")
    for name, value in given.items():
        if not _fits(value, hints[name]):
            raise CheckpointError(f"'{where}': {family} hyper-parameter '{name}' = {value!r} is not "
                                  f"{_type_name(hints[name])}")
        if isinstance(value, int) and not isinstance(value, bool) and name in floors and value < floors[name]:
            raise CheckpointError(f"'{where}': {family} hyper-parameter '{name}' = {value} must be >= {floors[name]}")
    required = [name for name, f in fields.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [name for name in required if name not in given]
    if missing:
        raise CheckpointError(f"'{where}': the {family} hyper-parameter '{missing[0]}' is missing")
    try:  # JSON has lists where the dataclass holds tuples (a hashable, frozen value)
        args = args_cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in given.items()})
        checks.check_args(args)  # the family's rules, as for a run's config
        build_on_meta(family, args, torch.float32)  # shapes only, no storage: sizes that cannot build a model
    except (TypeError, ValueError, RuntimeError, AssertionError,
            ZeroDivisionError) as err:  # ConfigError is a ValueError
        raise CheckpointError(f"'{where}': the {family} hyper-parameters do not fit together "
                              f"({first_error_line(err)})") from None
    return family, flavor, args


def newest_step_dir(run_dir: Path) -> Path:
    """A run directory's newest complete checkpoint (checkpoints/step-N holding model.json), as load_model reads it."""
    steps = [(int(m.group(1)), p) for p in (run_dir / "checkpoints").iterdir()
             if (m := re.fullmatch(r"step-(\d+)", p.name)) and (p / MODEL_JSON).is_file()]
    if not steps:
        raise UserFileNotFound(f"'{run_dir / 'checkpoints'}' holds no complete checkpoint "
                               f"(expected step-N/{MODEL_JSON})")
    return max(steps)[1]


def ember_step_dir(path: Path) -> Optional[Path]:
    """The checkpoint an ember path names: itself (it holds model.json), a run directory's newest complete
    step, or None (not an ember checkpoint)."""
    if (path / MODEL_JSON).is_file():
        return path
    return newest_step_dir(path) if (path / "checkpoints").is_dir() else None


def read_model_json(path: Path) -> tuple[str, str, DecoderArgs]:
    """(family, flavor, args) of a checkpoint's model.json: the one way ember reads it (parse_model_meta)."""
    return parse_model_meta(read_json(path), path)


def _fits(value: Any, hint: Any) -> bool:
    """Whether a JSON value has a hyper-parameter's annotated type: int, float (an int is fine), bool, str or
    an Optional/union of them. bool is not an int here (JSON true for a size is a mistake)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_fits(value, option) for option in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if hint in (bool, str):
        return isinstance(value, hint)
    if typing.get_origin(hint) is tuple:  # tuple[int, ...]: a JSON list of them
        item = typing.get_args(hint)[0]
        return isinstance(value, list) and all(_fits(v, item) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))  # another annotation: any JSON scalar


def _type_name(hint: Any) -> str:
    options = [h for h in typing.get_args(hint) if h is not type(None)] or [hint]
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    text = " or ".join(names.get(h, getattr(h, "__name__", str(h))) for h in options)
    return text + (" or null" if type(None) in typing.get_args(hint) else "")


def build_on_meta(family: str, args: DecoderArgs, dtype: torch.dtype) -> Decoder:
    """The family's model for `args` on the meta device: its shapes, no storage."""
    with torch.device("meta"):
        return MODELS[family].model_cls(args).to(dtype)  # costs nothing: no storage on meta


def meta_for(family: str, flavor: str, args: DecoderArgs) -> dict[str, Any]:
    return {"family": family, "flavor": flavor, "args": dataclasses.asdict(args)}


class ArchitectureMismatch(CheckpointError):
    """A checkpoint of another model than the run's (layers, sizes, RoPE, family...)."""


def _config_key(arg: str) -> str:
    """The config key that sets a model hyper-parameter: model.<arg>, else the flavor it comes from."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    arg = arg.removesuffix("_override")  # ffn_hidden_dim's field in the args
    return f"model.{arg}" if arg in fields else f"model.flavor ({arg})"


def architecture_differences(saved: dict[str, Any], run: dict[str, Any]) -> list[str]:
    """'key: checkpoint X, this run Y' for each hyper-parameter (and the family) that differs, named by config key."""
    diffs = []
    if saved.get("family") != run.get("family"):
        diffs.append(f"model.family: checkpoint {saved.get('family')}, this run {run.get('family')}")
    saved_args, run_args = saved.get("args") or {}, run.get("args") or {}
    for key in sorted(set(saved_args) | set(run_args)):
        if saved_args.get(key) != run_args.get(key):
            diffs.append(f"{_config_key(key)}: checkpoint {saved_args.get(key)}, this run {run_args.get(key)}")
    return diffs


def check_architecture(step_dir: Path, meta: dict[str, Any]) -> None:
    """Refuse a checkpoint whose model.json describes another architecture than the run's `meta`: loading it
    would drop layers silently, or keep a changed RoPE base with weights trained for the old one."""
    saved = meta_for(*read_model_json(step_dir / MODEL_JSON))  # every key checked; defaults filled in
    diffs = architecture_differences(saved, meta)
    if diffs:
        more = f" (and {len(diffs) - 3} more)" if len(diffs) > 3 else ""
        raise ArchitectureMismatch(
            f"checkpoint {step_dir} is of another model: {'; '.join(diffs[:3])}{more}. The model's architecture "
            "cannot change on resume, not even with resume_allow_changes: resume with the checkpoint's model config, "
            "or start over with resume=none (the old run is moved aside) or a new output_dir")
