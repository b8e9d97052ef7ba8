"""The shape of a run's mesh: the degree of every parallel axis from ici_mesh / dcn_mesh and the world size.

Plain arithmetic, no torch: config validation and `ember report` (which reads files only) resolve a mesh
without importing torch.distributed; parallel/mesh.py builds the DeviceMesh from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Union

from ember.config_schema import MeshConfig

# Outermost to innermost: the innermost axes get neighbouring ranks, so tensor parallelism (the most
# traffic) runs between processes of one node, then context, then FSDP; pipeline traffic (the least) is outermost.
AXES = ("pipeline", "data", "fsdp", "context", "expert", "tensor")


class MeshError(ValueError):
    """The mesh does not fit the world; ember.train.engines.mesh_shape turns this into a one-line ConfigError."""


@dataclass(frozen=True)
class MeshShape:
    """The resolved degree of every axis, split into its across-node (dcn) and within-node (ici) factors."""

    ici: dict[str, int]
    dcn: dict[str, int]

    def degree(self, axis: str) -> int:
        return self.ici[axis] * self.dcn[axis]

    @property
    def world_size(self) -> int:
        return math.prod(self.degree(a) for a in AXES)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different micro-batches are read at once (data x fsdp x expert:
        expert-parallel ranks read batches of their own, as in MaxText, and exchange tokens only inside
        the MoE layers)."""
        return self.degree("data") * self.degree("fsdp") * self.degree("expert")

    @property
    def grad_sync(self) -> int:
        """Ranks whose gradients FSDP reduces for the non-expert parameters: data x fsdp x expert x context
        (context shares the FSDP group)."""
        return self.dp * self.degree("context")

    def describe(self) -> str:
        parts = [f"{a}={self.degree(a)}" for a in AXES if self.degree(a) > 1]
        return " x ".join(parts) if parts else "single device"


def _axes(section: Union[MeshConfig, SimpleNamespace]) -> dict[str, int]:
    return {axis: int(getattr(section, axis)) for axis in AXES}


def fewest_ranks(ici_section: Union[MeshConfig, SimpleNamespace],
                 dcn_section: Union[MeshConfig, SimpleNamespace]) -> int:
    """The smallest world size the meshes' fixed degrees need (an axis of -1 filled with 1): a recipe with an
    expert axis of 8 runs on 8 ranks or a multiple."""
    return math.prod(max(degree, 1) for section in (ici_section, dcn_section) for degree in _axes(section).values())


def resolve_mesh(ici_section: Union[MeshConfig, SimpleNamespace], dcn_section: Union[MeshConfig, SimpleNamespace],
                 world_size: int) -> MeshShape:
    """Fill in the one -1 axis and check that the axes multiply to the world size."""
    ici, dcn = _axes(ici_section), _axes(dcn_section)
    free = [(name, axis) for name, mesh in (("ici_mesh", ici), ("dcn_mesh", dcn))
            for axis, v in mesh.items() if v == -1]
    for name, mesh in (("ici_mesh", ici), ("dcn_mesh", dcn)):
        for axis, value in mesh.items():
            if value == 0 or value < -1:
                raise MeshError(f"{name}.{axis}={value}: a degree must be a positive integer or -1 (whatever is left)")
    if len(free) > 1:
        names = ", ".join(f"{n}.{a}" for n, a in free)
        raise MeshError(f"only one axis may be -1, but {names} are; set all but one of them")
    fixed = math.prod(v for mesh in (ici, dcn) for v in mesh.values() if v != -1)
    if free:
        name, axis = free[0]
        if world_size % fixed:
            raise MeshError(
                f"the world size {world_size} is not divisible by the product of the other mesh axes ({fixed}), "
                f"so {name}.{axis}=-1 cannot fill it; change the degrees or the number of processes"
            )
        (ici if name == "ici_mesh" else dcn)[axis] = world_size // fixed
    shape = MeshShape(ici=ici, dcn=dcn)
    if shape.world_size != world_size:
        product = " x ".join(f"{a}={shape.degree(a)}" for a in AXES if shape.degree(a) > 1) or "1"
        raise MeshError(
            f"ici_mesh x dcn_mesh = {product} = {shape.world_size} devices, but the world size is {world_size}; "
            f"make the axes multiply to the number of processes (or set one axis to -1)"
        )
    return shape
