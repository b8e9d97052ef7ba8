"""The typed model arguments: every family's args extend DecoderArgs (ember/nn/args.py), the decoder reads them by
attribute, never by probing (`getattr(args, ...)`), each family's validate() refuses what does not fit in one line,
and model.json files written before DecoderArgs existed still load as the same hyper-parameters."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from ember.errors import ConfigError
from ember.model_io.model_meta import meta_for, parse_model_meta
from ember.models import MODELS, build_model_args
from ember.models.hf_mapping import HFMapping
from ember.nn.args import DecoderArgs
from ember.nn.decoder import has_local_attention

NN = Path(__file__).resolve().parents[2] / "ember" / "nn"
# model.json of each family's debug flavor (llama2: 7B, it has no debug) as commit 134b12a wrote it, before
# DecoderArgs: its keys in the families' old field order
OLD_MODEL_JSON = Path(__file__).with_name("model_json_before_decoder_args.json")


def _flavor(family: str) -> DecoderArgs:
    flavors = MODELS[family].flavors
    return flavors["debug"] if "debug" in flavors else next(iter(flavors.values()))


def test_no_args_probe_in_nn():
    """nn/ reads a DecoderArgs' typed attributes and methods; a probe would hide a family that lacks one."""
    probe = re.compile(r"\b(get|has)attr\(\s*args\b")
    found = [f"{path.name}:{n}" for path in sorted(NN.glob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if probe.search(line)]
    assert found == []


@pytest.mark.parametrize("family", sorted(MODELS))
def test_every_family_is_typed(family: str):
    spec = MODELS[family]
    assert issubclass(spec.args_cls, DecoderArgs) and dataclasses.is_dataclass(spec.args_cls)
    assert all(type(args) is spec.args_cls for args in spec.flavors.values())
    assert isinstance(spec.hf, HFMapping)  # every conversion and family_of, GLaM's refusing
    assert spec.hf.family_of(_flavor(family)) in MODELS


# (family, a value its validate() refuses, what the one line says)
BAD: list[tuple[str, dict[str, Any], str]] = [
    ("llama3", {"dim": 250}, r"^model\.dim=250 must split into model\.n_heads=8 heads of even size"),
    ("llama2", {"n_kv_heads": 5}, r"n_heads must be a multiple of model\.n_kv_heads=5$"),
    ("mistral", {"head_dim_override": 33}, r"^model\.head_dim=33 must be a positive even number"),
    ("mixtral", {"top_k": 9}, r"^model\.top_k=9 must be at most model\.n_experts=8$"),
    ("glam", {"top_k": 9}, r"^model\.top_k=9 must be at most model\.n_experts=8$"),
    ("gpt", {"n_heads": 6}, r"^model\.dim=256 must split into model\.n_heads=6 heads"),
    ("phi3", {"rope_scaling_factor": 8.0}, r"^rope_scaling_factor=8\.0 is Llama 3\.1's RoPE scaling"),
    ("gemma3", {"rope_scaling_factor": 8.0}, r"^rope_scaling_factor=8\.0 is Llama 3\.1's RoPE scaling"),
    ("llama4", {"attn_scale": float("nan")}, r"^model\.attn_scale=nan must be a finite number >= 0$"),
    ("qwen2", {"max_window_layers": 2}, r"^model\.max_window_layers=2 must be the first layer with the sliding window"),
    ("qwen3_moe", {"moe_hidden_dim": 0}, r"^model\.moe_hidden_dim=0 must be >= 1 with model\.n_experts=16"),
    ("deepseek_v3", {"qk_rope_head_dim": 15}, r"^model\.qk_rope_head_dim=15 must be even .*; use 14 or 16$"),
    ("deepseek_v2", {"route_scale": -1.0}, r"^model\.route_scale=-1\.0 must be a finite number >= 0$"),
]


def test_the_bad_values_cover_every_args_class():
    assert {MODELS[family].args_cls for family, _, _ in BAD} == {spec.args_cls for spec in MODELS.values()}


@pytest.mark.parametrize("family, bad, message", BAD, ids=[f"{f}-{next(iter(b))}" for f, b, _ in BAD])
def test_validate_refuses_in_one_line(family: str, bad: dict[str, Any], message: str):
    args = dataclasses.replace(_flavor(family), **bad)
    with pytest.raises(ConfigError) as err:
        args.validate()
    assert re.search(message, str(err.value)) and "\n" not in str(err.value)


@pytest.mark.parametrize("family", sorted(json.loads(OLD_MODEL_JSON.read_text())))
def test_a_model_json_from_before_decoder_args_loads_as_the_same_model(family: str):
    """The same keys and values: the old file reads back as the flavor it was written from, and a file written
    now holds exactly its keys (JSON's key order is no part of the format: model.json is read key by key)."""
    old = json.loads(OLD_MODEL_JSON.read_text())[family]
    got_family, flavor, args = parse_model_meta(old, OLD_MODEL_JSON)
    assert (got_family, flavor) == (family, old["flavor"]) and args == MODELS[family].flavors[flavor]
    assert json.loads(json.dumps(meta_for(family, flavor, args))) == old  # as a checkpoint writes it


def test_the_typed_rope_of_each_kind():
    kinds = {family: (args.rope.kind if args.rope else None, args.local_rope.kind if args.local_rope else None)
             for family in MODELS for args in [_flavor(family)]}
    assert kinds["gpt"] == (None, None)  # learned positions
    assert kinds["llama3"] == kinds["qwen3"] == kinds["gemma2"] == ("default", None)
    assert kinds["llama3.1"] == ("llama3", None) and kinds["deepseek_v3"] == ("yarn", None)
    assert kinds["gemma3"] == ("linear", "default")  # global layers interpolated, local ones on their own base
    phi = _flavor("phi3")
    long = dataclasses.replace(phi, rope_short_factor=(1.0,) * 16, rope_long_factor=(2.0,) * 16,
                               rope_original_max_seq_len=512)
    assert long.rope.kind == long.long_rope.kind == "longrope" and phi.long_rope is None
    assert long.rope.table_scale == math.sqrt(1 + math.log(2048 / 512) / math.log(512))  # from max_seq_len
    deepseek = _flavor("deepseek_v3")
    assert deepseek.rope.rotary_dim == deepseek.qk_rope_head_dim < deepseek.head_dim  # the rope part only


def test_the_layer_rules_have_defaults_for_dense_global_models():
    gpt, mixtral, gemma = _flavor("gpt"), _flavor("mixtral"), _flavor("gemma3")
    assert not has_local_attention(gpt) and not any(map(gpt.is_moe_layer, range(gpt.n_layers)))
    assert not gpt.uses_rope(0) and all(map(mixtral.is_moe_layer, range(mixtral.n_layers)))
    assert has_local_attention(gemma) and gemma.layer_span(5) is None  # every sixth layer is global


def test_a_stated_head_width_equal_to_the_derived_one_is_dropped():
    assert build_model_args("qwen3", "debug", {"head_dim": 32}).head_dim_override is None  # 256 / 8
    assert build_model_args("qwen3", "debug", {"head_dim": 64}).head_dim_override == 64
