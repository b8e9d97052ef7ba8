"""ici_mesh / dcn_mesh -> one jax.sharding.Mesh, with the same axes and degrees as the torch.distributed path.

Every axis of parallel/mesh_shape.AXES but pipeline (the XLA path has no pipeline; checks.py refuses it) is a
mesh axis, degree-1 axes included: a PartitionSpec naming one then shards nothing. On TPUs the devices are
laid out by jax's mesh_utils, which knows the torus: `create_device_mesh` within a slice, and with dcn degrees
> 1 `create_hybrid_device_mesh`, whose dcn factor of each axis spans slices (MaxText's and torchprime's
multi-slice layout). Elsewhere (jax's CPU devices) the devices are placed as parallel/mesh.rank_grid places
torch ranks: process-major, each axis' coordinate dcn_coord x ici + ici_coord.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ember.parallel.mesh import rank_grid
from ember.parallel.mesh_shape import AXES, MeshShape

MESH_AXES = tuple(a for a in AXES if a != "pipeline")
# The batch dimension is split over every axis whose ranks read batches of their own (MeshShape.dp).
BATCH_AXES = ("data", "fsdp", "expert")


def jax_mesh(shape: MeshShape, devices: list[Any]) -> Any:
    """The run's Mesh over `devices` (all hosts'), axes MESH_AXES."""
    from jax.sharding import Mesh

    ici = [shape.ici[a] for a in MESH_AXES]
    dcn = [shape.dcn[a] for a in MESH_AXES]
    if devices[0].platform == "tpu":
        from jax.experimental import mesh_utils

        grid = (mesh_utils.create_hybrid_device_mesh(ici, dcn, devices) if np.prod(dcn) > 1
                else mesh_utils.create_device_mesh(ici, devices))
    else:
        ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
        grid = np.array(ordered, dtype=object)[rank_grid(shape, MESH_AXES).numpy()]
    return Mesh(grid, MESH_AXES)


def present(mesh: Any, axes: tuple[str, ...]) -> tuple[str, ...]:
    """`axes` of degree > 1 on `mesh`."""
    return tuple(a for a in axes if mesh.shape[a] > 1)


def batch_spec(mesh: Any) -> Any:
    """(B, T) token batches: rows over the data-parallel axes, the sequence over context."""
    from jax.sharding import PartitionSpec as P

    return P(present(mesh, BATCH_AXES) or None, present(mesh, ("context",)) or None)


def hidden_spec(mesh: Any) -> Any:
    """(B, T, dim) hidden states between blocks: rows as the batch, the sequence over context and tensor
    (sequence parallelism: the norms and residual adds run on T / (context x tensor) tokens per device)."""
    from jax.sharding import PartitionSpec as P

    return P(present(mesh, BATCH_AXES) or None, present(mesh, ("context", "tensor")) or None, None)
