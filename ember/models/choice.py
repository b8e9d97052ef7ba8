"""The model a run trains, beside build_model_args: from a flavor with the user's overrides, or from what
model.init_from describes (its architecture asked of the loading layer, ember/model_io/load.py, once: no weight
is read)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

from ember.errors import ConfigError
from ember.model_io.load import source_architecture
from ember.model_io.model_meta import MODEL_JSON
from ember.model_io.sources import Architecture
from ember.models import MODELS, build_model_args, not_a_hyperparameter
from ember.nn.args import DecoderArgs


@dataclasses.dataclass(frozen=True)
class ModelChoice:
    """The model a run trains: its family, flavor label and hyper-parameters, and where they came from."""

    family: str
    flavor: str
    args: DecoderArgs
    source: Optional[str] = None  # model.init_from's description file, when the architecture comes from it


def _described_by_model_json(source: Architecture) -> bool:
    """Whether the source says its family (an ember model.json); an HF config.json does not say which Llama it is."""
    return Path(source.where).name == MODEL_JSON


def source_family(recipe_family: str, init_from: str) -> str:
    """The family a run with model.init_from builds when the command line names none: the source's, as its
    model.json says; an HF directory's config.json does not say which Llama it is, so there the recipe's family
    stands when it is a Llama too."""
    source = source_architecture(init_from)
    same_kind = recipe_family in MODELS and MODELS[recipe_family].args_cls is MODELS[source.family].args_cls
    return recipe_family if not _described_by_model_json(source) and same_kind else source.family


def resolve_model(family: str, flavor: str, overrides: dict[str, Any], init_from: Optional[str]) -> ModelChoice:
    """The run's model. Without init_from: the flavor with the user's `model.<key>` overrides. With it, the
    architecture is the source's (config.json or model.json), so nothing needs restating; an override that
    contradicts it is refused naming the key and both values (silently training another architecture on
    those weights is the failure this prevents). A RoPE model's max_seq_len may differ: it sizes the RoPE
    table, no weight. The family must be the source's (any Llama family for an HF Llama directory, which
    does not say which Llama it is; config.load puts the source's in place of a recipe's), and the flavor is
    a label: none of its sizes is built."""
    if not init_from:
        return ModelChoice(family, flavor, build_model_args(family, flavor, overrides))  # also checks the keys
    source = source_architecture(init_from)
    src_family, src_args, where = source.family, source.args, source.where
    same_class = MODELS[family].args_cls is MODELS[src_family].args_cls
    if not same_class or (family != src_family and _described_by_model_json(source)):
        raise ConfigError(f"model.family={family} but model.init_from {where} describes a {src_family} model; "
                          "drop model.family (the architecture comes from model.init_from)")
    keys = MODELS[family].args_cls.CONFIG_KEYS  # config key -> field, where they differ
    fields = {f.name for f in dataclasses.fields(src_args)} - set(keys.values()) | set(keys)
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ConfigError(not_a_hyperparameter(unknown[0], family, fields))
    for key, value in sorted(overrides.items()):
        if key == "max_seq_len" and src_args.rope is not None:
            continue
        have = getattr(src_args, key)  # a config key: ffn_hidden_dim reads Llama's derived size
        if value != have:
            raise ConfigError(f"model.{key}={value} contradicts model.init_from {where} ({key} {have}); the "
                              f"architecture comes from model.init_from: drop model.{key}")
    field_overrides = {keys.get(k, k): v for k, v in overrides.items() if k == "max_seq_len"}
    args = dataclasses.replace(src_args, **field_overrides)
    return ModelChoice(family, source.flavor, args, str(where))
