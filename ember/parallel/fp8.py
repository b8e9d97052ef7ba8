"""FP8 training with torchao's float8 (`precision=fp8`, or `fp8.enabled=true fp8.recipe=tensorwise|rowwise`).

Every nn.Linear of the blocks becomes torchao's Float8Linear: its matmuls (forward and both backward ones) run
in float8 with dynamic scales (e4m3 for inputs and weights, e5m2 for gradients), accumulating in higher
precision; the parameters, optimizer state and everything else stay as they were. Kept out:
- the output projection (its logits feed the loss directly; torchtitan and Pax keep it in bf16 too), and the
  MoE routers (their few logits pick experts: a rounding flip changes the route);
- linears whose dimensions 16 does not divide (torch._scaled_mm's requirement).
With FSDP and the tensorwise recipe, parameters are all-gathered already in float8 (half the bytes of bf16)
and the scales of every weight are computed in one go after the optimizer step
(`precompute_float8_dynamic_scale_for_fsdp`), as torchao's FSDP2 integration requires; under tensor
parallelism the tensorwise recipe uses torchao's float8 parallel styles, so activations cross ranks in float8.

torchao is the optional extra `pip install -e '.[fp8]'`. FP8 matmuls need Hopper or newer (compute capability
8.9+, MI300X); `fp8.emulate=true` runs the same conversion with the float8 arithmetic emulated in higher
precision, which is what CPU tests use.
"""

from __future__ import annotations

import dataclasses
import logging
from types import ModuleType
from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch import nn

from ember.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

    from ember.parallel.mesh import ParallelMesh

RECIPES = ("tensorwise", "rowwise")
KEEP_HIGH_PRECISION = ("output", "router")  # module names (and their children) left out of the conversion


def _import_float8() -> ModuleType:
    # torchao warns for each optional kernel library its wheel cannot load here (CUDA-arch specific ones on
    # another GPU or a CPU); float8 training does not use them.
    logging.getLogger("torchao").setLevel(logging.ERROR)
    # torchao registers its KernelPreference enum with torch.utils._pytree.register_constant at import, which this
    # torch logs as deprecated (enums are opaque values to torch.compile now): torchao's matter, harmless to float8
    # training, and a warning line on every rank's stderr. Only that record is dropped.
    logging.getLogger("torch.utils._pytree").addFilter(_not_the_kernel_preference_notice)
    try:
        import torchao.float8 as float8
    except ImportError:
        raise ConfigError("fp8 training needs torchao: pip install -e '.[fp8]' torch==<your torch>, or drop "
                          "precision=fp8 / fp8.enabled") from None
    return float8


def _not_the_kernel_preference_notice(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not ("KernelPreference" in message and "register_constant() on Enum subclasses is deprecated" in message)


def check_fp8_device(device: torch.device, emulate: bool) -> None:
    """FP8 matmuls run on Hopper/Ada (compute capability >= 8.9) and newer; elsewhere only emulated."""
    if emulate:
        return
    if device.type != "cuda":
        raise ConfigError(f"fp8 training needs a GPU with FP8 matmuls (H100/H200/B200, compute capability >= 8.9); "
                          f"this run is on {device.type}: use precision=bf16, "
                          "or fp8.emulate=true to test the code path")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ConfigError(f"fp8 training needs compute capability >= 8.9 (Hopper, Ada, Blackwell); {name} is "
                          f"{major}.{minor}: use precision=bf16")


def _keeps_high_precision(module: nn.Module, fqn: str) -> bool:
    parts = fqn.split(".")
    if any(part in KEEP_HIGH_PRECISION for part in parts):
        return True
    return isinstance(module, nn.Linear) and (module.in_features % 16 or module.out_features % 16)


def apply_fp8(model: nn.Module, recipe: str, emulate: bool, fsdp_float8_all_gather: bool) -> list[str]:
    """Convert `model`'s linears to Float8Linear in place (before TP, compile and FSDP, as torchao wants);
    returns the converted module names."""
    float8 = _import_float8()
    if recipe == "tensorwise":
        config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_float8_all_gather, emulate=emulate)
    else:  # rowwise scales (one per row of each operand): better accuracy, no float8 all-gather in torchao
        config = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    float8.convert_to_float8_training(model, config=config,
                                      module_filter_fn=lambda module, fqn: not _keeps_high_precision(module, fqn))
    from torchao.float8.float8_linear import Float8Linear

    return [name for name, module in model.named_modules() if isinstance(module, Float8Linear)]


def describe_fp8(model_parts: list[nn.Module], recipe: str, emulate: bool, compute_dtype: torch.dtype) -> str:
    """What an FP8 run computes in, for the run header and run.json: e.g. `fp8 tensorwise (emulated in bfloat16)
    in 14 of 15 linears, bfloat16 elsewhere`. Emulated float8 rounds as float8 does but multiplies in
    `compute_dtype`: the numbers of FP8, not its speed."""
    from torchao.float8.float8_linear import Float8Linear

    modules = [m for part in model_parts for m in part.modules()]
    converted = sum(isinstance(m, Float8Linear) for m in modules)
    linears = sum(isinstance(m, nn.Linear) for m in modules)  # Float8Linear is an nn.Linear
    dtype = str(compute_dtype).replace("torch.", "")
    emulated = f" (emulated in {dtype})" if emulate else ""
    return f"fp8 {recipe}{emulated} in {converted} of {linears} linears, {dtype} elsewhere"


def fp8_tp_plan(plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """The tensorwise recipe's TP plan: torchao's float8 styles in place of the colwise/rowwise ones and of
    the block inputs' layout change, so the all-gathered activations travel in float8 (torchtitan's plan)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    swapped = {}
    for name, style in plan.items():
        if type(style) is ColwiseParallel and not name.endswith("output"):
            style = Float8ColwiseParallel(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                                          use_local_output=style.use_local_output)
        elif type(style) is RowwiseParallel and "embeddings" not in name:
            style = Float8RowwiseParallel(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                                          use_local_output=style.use_local_output)
        elif type(style) is PrepareModuleInput and name in ("attention", "feed_forward"):
            style = PrepareFloat8ModuleInput(input_layouts=style.input_layouts,
                                             desired_input_layouts=style.desired_input_layouts,
                                             float8_dtype=torch.float8_e4m3fn)
        swapped[name] = style
    return swapped


def fp8_all_gather(mesh: Optional[ParallelMesh], recipe: str) -> bool:
    """Whether FSDP all-gathers the weights in float8: the tensorwise recipe, when FSDP shards them."""
    return recipe == "tensorwise" and mesh is not None and mesh.fsdp_mesh() is not None


def fp8_after_optimizer_step(model_parts: list[nn.Module], mesh: Optional[ParallelMesh],
                             recipe: str) -> Optional[Callable[[], None]]:
    """What must run after each optimizer step: with FSDP's float8 all-gather (tensorwise), every weight's
    scale computed in one fused pass for the next all-gather; otherwise nothing."""
    if not fp8_all_gather(mesh, recipe):
        return None
    float8 = _import_float8()

    def precompute() -> None:
        for part in model_parts:
            float8.precompute_float8_dynamic_scale_for_fsdp(part)

    return precompute
