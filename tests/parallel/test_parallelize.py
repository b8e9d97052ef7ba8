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

# deepseek_v3: MLA, whose kernel is swapped alike; llama4: NoPE and chunked layers
FAMILIES = ["llama3", "mixtral", "glam", "gpt", "deepseek_v3", "llama4"]


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


@pytest.mark.parametrize("family", ["mistral", "llama4"])  # sliding windows; chunked and NoPE layers
def test_flex_masks_are_built_before_compiled_blocks_so_new_batches_do_not_recompile(
        family: str, monkeypatch: pytest.MonkeyPatch):
    # Compiled blocks once read a mask cache keyed by the document_ids tensor: every batch failed a guard, and
    # after 8 recompilations a fullgraph block raised (Qwen3-MoE on an H100). The masks now come from the model's
    # forward pre-hook; a block compiles once per kind of layer, and later batches reuse them. CPU: flex
    # attention runs forward only here, and the blocks compile with aot_eager (the guards are dynamo's either way).
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compile_module(self, backend="aot_eager", **kw))
    torch.manual_seed(0)
    model = MODELS[family].model_cls(build_model_args(family, "debug", {"n_layers": 4, "max_seq_len": 256}))
    model.init_weights()
    parallelize(model, None, MODELS[family].tp_plan, ParallelOptions(flex_attention=True, compile=True))
    torch._dynamo.reset()
    frames = []
    with torch.no_grad():
        for batch in range(3):
            tokens = torch.randint(0, 256, (2, 160), generator=torch.Generator().manual_seed(batch))
            document_ids = (torch.arange(160) >= 40 + 30 * batch).long().expand(2, -1)  # two documents
            positions = torch.arange(160) - torch.where(document_ids[0] == 1, 40 + 30 * batch, 0)
            out = model(tokens, positions.expand(2, -1), document_ids)
            frames.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
            assert torch.isfinite(out).all() and isinstance(model.layers["0"].attention.attention_fn, FlexAttention)
    assert frames[0] > 0 and frames[1] == frames[2] == frames[0], frames
