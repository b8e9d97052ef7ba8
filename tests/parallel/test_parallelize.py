"""The one parallelize pipeline on a single device: every family gets every option it is given (no option
silently dropped), parameter names stay as they were, and compile skips only MoE layers."""

from __future__ import annotations

import inspect

import pytest
import torch

from ember.models import MODELS, build_model_args
from ember.nn.attention import FlexAttention, causal_attention
from ember.nn.moe import MoE
from ember.parallel.parallelize import ParallelOptions, parallelize

FAMILIES = ["llama3", "mixtral", "glam", "gpt", "deepseek_v3", "llama4"]  # deepseek_v3: MLA, whose kernel is swapped alike;
# llama4: NoPE and chunked layers


def _model(family: str) -> torch.nn.Module:
    spec = MODELS[family]
    with torch.device("meta"):
        return spec.model_cls(build_model_args(family, "debug", {"n_layers": 2}))


def test_parallelize_takes_no_catch_all_options():
    # A family that cannot do something is refused at config time; nothing here may swallow an option.
    kinds = {p.kind for p in inspect.signature(parallelize).parameters.values()}
    assert inspect.Parameter.VAR_KEYWORD not in kinds and inspect.Parameter.VAR_POSITIONAL not in kinds


@pytest.mark.parametrize("family", FAMILIES)
def test_document_masking_gets_flex_attention_in_every_family(family: str):
    # Mixtral and GLaM used to drop flex_attention=True silently and fall back to a dense (B, 1, T, T) mask.
    model = _model(family)
    assert all(block.attention.attention_fn is causal_attention for block in model.layers.values())
    parallelize(model, None, MODELS[family].tp_plan, ParallelOptions(flex_attention=True))
    kernels = {id(block.attention.attention_fn) for block in model.layers.values()}
    assert len(kernels) == 1  # one kernel for every layer: the BlockMask is built once per batch
    assert isinstance(model.layers["0"].attention.attention_fn, FlexAttention)


@pytest.mark.parametrize("family", FAMILIES)
def test_compile_and_remat_keep_names_and_leave_moe_layers_eager(family: str):
    model = _model(family)
    names = [name for name, _ in model.named_parameters()]
    assert parallelize(model, None, MODELS[family].tp_plan, ParallelOptions(compile=True, remat="full")) is model
    assert [name for name, _ in model.named_parameters()] == names
    for block in model.layers.values():
        moe = [m for m in block.children() if isinstance(m, MoE)]
        if not model.moe_layers():
            assert block._compiled_call_impl is not None  # a dense model: whole blocks
            continue
        assert block._compiled_call_impl is None
        assert all(m._compiled_call_impl is None for m in moe)
        assert block.attention._compiled_call_impl is not None and block.attention_norm._compiled_call_impl is not None
