"""FSDP2 (`fully_shard`) per block, on the embeddings, on the final norm + output, and on the root."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

if TYPE_CHECKING:
    from torch.distributed.tensor import Shard


def apply_fsdp(
    model: nn.Module,
    mesh: Optional[DeviceMesh],
    *,
    param_dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = None,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    own_units: Sequence[tuple[nn.Module, Optional[DeviceMesh]]] = (),
) -> None:
    """Shard `model` (a whole model or a pipeline stage of one) over `mesh`, in place.

    A 2-D mesh (replicate, shard) gives HSDP: gradients are reduce-scattered within a shard group and
    all-reduced across replicas. Each block is its own unit so only one block's parameters are gathered
    at a time; the embedding, and the final norm with the output projection, are units of their own.
    A tied embedding/output matrix is left to the root unit, since one parameter cannot live in two.

    own_units: (module, its mesh) for parts of the model whose parameters are shared, and so reduced, by
    other ranks than the rest: expert-parallel experts (only the ranks holding the same experts), a MoE
    layer under tensor parallelism (tensor ranks route different tokens). Listed inner first, each is a
    unit over its own mesh; where the mesh is None (nothing to reduce: the expert axis is the only data
    axis) FSDP leaves its parameters alone, their gradients being whole. `mesh` None: only these units.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    ignored: set[nn.Parameter] = set()
    for module, unit_mesh in own_units:
        if unit_mesh is not None:
            fully_shard(module, mesh=unit_mesh, mp_policy=mp, offload_policy=offload,
                        reshard_after_forward=reshard_after_forward, shard_placement_fn=_stacked_placement(unit_mesh))
        else:
            ignored.update(module.parameters())
    if mesh is not None:
        # experts stacked in a block (no expert parallelism) split as own units' are: Mixtral's 8 over fsdp=256
        # left whole on 8 ranks and empty on 248 (21 GiB each on those 8 in ember plan)
        common = dict(mesh=mesh, mp_policy=mp, offload_policy=offload, ignored_params=ignored or None,
                      shard_placement_fn=_stacked_placement(mesh))
        tied = getattr(model.args, "tie_embeddings", False)
        if model.tok_embeddings is not None and not tied:
            fully_shard(model.tok_embeddings, reshard_after_forward=reshard_after_forward, **common)
        for block in model.layers.values():
            fully_shard(block, reshard_after_forward=reshard_after_forward, **common)
        head = [m for m in (model.norm, model.output) if m is not None]
        if head and not tied:
            # Not resharded after forward: backward starts here at once and would gather it straight back.
            fully_shard(head, reshard_after_forward=False, **common)
        fully_shard(model, reshard_after_forward=reshard_after_forward, **common)
    # ember's loss is already the mean over the global batch's tokens (ember/train/step.py divides by the global
    # token count), so the gradient reductions must sum, not average. gloo has no PREMUL_SUM, so the
    # reductions are forced to plain sums as well.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if hasattr(module, "set_force_sum_reduction_for_comms"):  # torch >= 2.9
                module.set_force_sum_reduction_for_comms(True)


def _stacked_placement(mesh: DeviceMesh) -> Callable[[nn.Parameter], Optional[Shard]]:
    """Where FSDP splits a stacked (experts, rows, cols) parameter: its default, dim 0, only when this rank's
    experts divide evenly over the mesh. With few experts per rank (Mixtral's 8 at expert=8: one each; all 8 at
    fsdp=256 without expert parallelism) dim 0 cannot be split, and FSDP would leave it whole on some ranks and
    empty on the others; the rows are split instead (torchtitan does the same)."""
    from torch.distributed.tensor import DTensor, Shard

    size = mesh.size(mesh.ndim - 1)  # HSDP's (replicate, shard) mesh splits over its last dimension only

    def placement(param: nn.Parameter) -> Optional[Shard]:
        local = param.to_local() if isinstance(param, DTensor) else param
        # FSDP2 splits any dim but 0 only evenly (NotImplementedError): rows that do not divide keep dim 0's
        if local.dim() == 3 and local.shape[0] % size and local.shape[1] % size == 0:
            return Shard(1)
        return None  # FSDP's default, Shard(0)

    return placement
