"""ici_mesh / dcn_mesh -> one DeviceMesh, and the sub-meshes each technique works on.

Every parallel axis has a degree dcn x ici. The DeviceMesh lays ranks out node-major (torchrun numbers
a node's processes consecutively) with, on each axis, the dcn factor outermost: the coordinate along
an axis is dcn_coord * ici + ici_coord, so the groups of an axis that is ici-only stay inside a node
and only the dcn part of an axis crosses the slow network (MaxText's ici/dcn split). Axes of degree 1
are left out of the DeviceMesh (no process groups for them), as in torchtitan.
"""

from __future__ import annotations

import datetime
import math
import os
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from ember.parallel.mesh_shape import AXES, MeshShape

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def rank_grid(shape: MeshShape, names: tuple[str, ...]) -> torch.Tensor:
    """The global rank at each mesh coordinate over axes `names`: rank = node * ranks_per_node + local
    rank, where the node unravels over the dcn degrees and the local rank over the ici degrees, and each
    axis' coordinate is dcn_coord * ici + ici_coord."""
    dcn = [shape.dcn[a] for a in names]
    ici = [shape.ici[a] for a in names]
    n = len(names)
    ranks = torch.arange(shape.world_size).reshape(dcn + ici)  # (dcn_a, dcn_b, ..., ici_a, ici_b, ...)
    interleaved = [i for pair in zip(range(n), range(n, 2 * n)) for i in pair]  # (dcn_a, ici_a, dcn_b, ...)
    return ranks.permute(interleaved).reshape([d * i for d, i in zip(dcn, ici)])


class ParallelMesh:
    """The job's DeviceMesh and the sub-meshes that FSDP, TP, PP and CP take (None: that axis is 1)."""

    def __init__(self, shape: MeshShape, device_type: str):
        from torch.distributed.device_mesh import DeviceMesh

        self.shape = shape
        # FSDP needs a replicate x shard mesh for HSDP; with data > 1 the fsdp axis is kept even at
        # degree 1 so that pure data parallelism is FSDP's replicate-only (DDP-style) form.
        keep = {a for a in AXES if shape.degree(a) > 1}
        if "data" in keep:
            keep.add("fsdp")
        self.names = tuple(a for a in AXES if a in keep)
        self.mesh = DeviceMesh(device_type, rank_grid(shape, self.names), mesh_dim_names=self.names)
        self._flattened: dict[tuple[str, ...], DeviceMesh] = {}

    def has(self, axis: str) -> bool:
        return axis in self.names

    def coordinate(self, axis: str) -> int:
        return self.mesh.get_coordinate()[self.names.index(axis)] if self.has(axis) else 0

    def submesh(self, *axes: str) -> Optional[DeviceMesh]:
        """The mesh over `axes` (those of degree > 1), several axes flattened into one; None if none."""
        present = tuple(a for a in axes if self.has(a) and self.shape.degree(a) > 1)
        if not present:
            return None
        if len(present) == 1:
            return self.mesh[present[0]]
        if present not in self._flattened:
            self._flattened[present] = self.mesh[present]._flatten("_".join(present))
        return self._flattened[present]

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel readers (data x fsdp x expert); tensor, pipeline and
        context ranks of one replica read the same batch."""
        index = 0
        for axis in ("data", "fsdp", "expert"):
            index = index * self.shape.degree(axis) + self.coordinate(axis)
        return index

    def fsdp_mesh(self) -> Optional[DeviceMesh]:
        """FSDP's mesh for the non-expert parameters: (data, fsdp x context x expert) for HSDP /
        replicate, fsdp x context x expert for FSDP, None if no gradients need reducing. Context and
        expert ranks hold the same (non-expert) parameters, so they shard them too."""
        return self._sharding_mesh(("fsdp", "context", "expert"))

    def moe_fsdp_mesh(self) -> Optional[DeviceMesh]:
        """FSDP's mesh for the router (and the experts, without expert parallelism) of a MoE layer under
        tensor parallelism: each tensor rank routes its own sequence shard, so for these parameters the
        tensor axis is one more data axis (Megatron-LM's "MoE parallel folding" with expert-TP 1)."""
        return self._sharding_mesh(("fsdp", "context", "expert", "tensor"))

    def expert_fsdp_mesh(self) -> Optional[DeviceMesh]:
        """FSDP's mesh for the experts of an expert-parallel MoE layer: the ranks that hold the same
        experts, (data, fsdp x context x tensor) or fsdp x context x tensor; None if only the expert
        axis splits the work."""
        return self._sharding_mesh(("fsdp", "context", "tensor"))

    def _sharding_mesh(self, shard_axes: tuple[str, ...]) -> Optional[DeviceMesh]:
        """(data, the shard axes flattened) with data > 1, else the shard axes flattened; None if these
        axes and data are all of degree 1 (nothing to reduce)."""
        if math.prod(self.shape.degree(a) for a in ("data", *shard_axes)) == 1:
            return None
        if not self.has("data"):
            return self.submesh(*shard_axes)
        shard = tuple(a for a in shard_axes if self.shape.degree(a) > 1) or ("fsdp",)
        if len(shard) > 1 and shard not in self._flattened:
            self._flattened[shard] = self.mesh[shard]._flatten("_".join(shard))
        return self.mesh[("data", "_".join(shard))]


def init_distributed(device: torch.device, timeout_s: int) -> None:
    """Join the torchrun job: gloo on CPU, NCCL on CUDA (RCCL on ROCm). Idempotent. The timeout bounds
    how long a rank waits on a peer that died, so a failure ends the job instead of hanging it."""
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
