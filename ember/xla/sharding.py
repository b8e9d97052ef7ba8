"""Each parameter's PartitionSpec over the run's jax Mesh, derived from what the torch.distributed path knows:

- tensor: the family's tensor-parallel plan (models/*/parallelize.py), read, not re-stated: a ColwiseParallel
  Linear splits its output features (weight dim 0, and its bias), a RowwiseParallel Linear its input features
  (weight dim 1); for an Embedding the two are the other way round (Rowwise splits the vocabulary, dim 0),
  as torch's own styles do. MoE experts (E, out, in) split their hidden units: w1/w3 dim 1, w2 dim 2.
- expert: an MoE layer's expert weights split dim 0 (the expert) over the expert axis.
- fsdp: every parameter is then sharded on its first free dimension divisible by the FSDP axes' product
  (fsdp x context, and expert for what is not an expert weight: those ranks hold different batches, so the
  weights they share are sharded among them too, as FSDP shards over data x fsdp x expert x context on the
  torch path); a parameter no free dimension of which divides stays replicated over them (a small bias).
GSPMD then inserts the all-gathers and reduce-scatters FSDP and Megatron-LM do by hand.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from ember.nn.moe import Experts
from ember.xla.mesh import present


def _plan_entries(model: nn.Module, tp_plan: Any) -> dict[str, Any]:
    """module name -> its tensor-parallel style, for every module of `model` the plan names."""
    top, block = tp_plan(False)
    entries = dict(top)
    for layer in model.layers:
        entries.update({f"layers.{layer}.{name}": style for name, style in block.items()})
    return entries


def _tensor_dim(module: nn.Module, param_name: str, style: Any) -> int | None:
    """The dimension of `module`'s parameter the tensor axis splits, or None."""
    if isinstance(module, Experts):
        return {"w1": 1, "w3": 1, "w2": 2}.get(param_name)
    colwise, rowwise = isinstance(style, ColwiseParallel), isinstance(style, RowwiseParallel)
    if isinstance(module, nn.Embedding):
        return 0 if rowwise else 1 if colwise else None
    if isinstance(module, nn.Linear):
        if param_name == "weight":
            return 0 if colwise else 1 if rowwise else None
        return 0 if colwise else None  # a row-wise Linear's bias is added once, after the reduction
    return None


def param_specs(model: nn.Module, tp_plan: Any, mesh: Any, names: list[str]) -> dict[str, Any]:
    """PartitionSpec of each parameter in `names` (model.named_parameters() names) of `model` on `mesh`."""
    from jax.sharding import PartitionSpec as P

    entries = _plan_entries(model, tp_plan) if mesh.shape["tensor"] > 1 else {}
    specs = {}
    for name in names:
        module_name, _, param_name = name.rpartition(".")
        module = model.get_submodule(module_name)
        shape = tuple(getattr(module, param_name).shape)
        axes: list[Any] = [None] * len(shape)
        expert_weight = isinstance(module, Experts)
        if expert_weight and mesh.shape["expert"] > 1 and shape[0] % mesh.shape["expert"] == 0:
            axes[0] = "expert"
        if module_name in entries or expert_weight:
            dim = _tensor_dim(module, param_name, entries.get(module_name))
            if dim is not None and mesh.shape["tensor"] > 1 and shape[dim] % mesh.shape["tensor"] == 0:
                axes[dim] = "tensor"
        fsdp = present(mesh, ("fsdp", "context") if expert_weight else ("fsdp", "expert", "context"))
        size = math.prod(mesh.shape[a] for a in fsdp)
        if fsdp:
            free = [d for d in range(len(shape)) if axes[d] is None and shape[d] % size == 0]
            if free:
                axes[free[0]] = fsdp if len(fsdp) > 1 else fsdp[0]
        specs[name] = P(*axes)
    return specs
