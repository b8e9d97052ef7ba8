"""Eval on a mesh: `ember eval` under torchrun / `--nproc-per-node` with training's mesh keys.

The model is built as training builds it (ember/eval/sharded.py: FSDP2 over data x fsdp, Megatron TP over
tensor) and loaded sharded, so a model that fits no single device is evaluated where it was trained.
Requests are split over the data-parallel ranks in whole batches and the scores gathered on every rank; ranks
of one replica (tensor) score the same batches. FSDP and TP run collectives inside every forward, so every rank
runs the same number of forwards: a rank whose share is shorter runs a one-token forward per missing batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence, TypeVar

import torch

from ember.config_schema import MeshConfig
from ember.errors import ConfigError

if TYPE_CHECKING:
    from ember.parallel.mesh_shape import MeshShape

Item = TypeVar("Item")

EVAL_AXES = ("data", "fsdp", "tensor")  # what eval applies; pipeline/context/expert are training layouts


@dataclass(frozen=True)
class EvalRanks:
    """Where this process stands in a distributed eval: its data-parallel coordinate among `dp_world`
    replicas, and the tensor-parallel degree (widths are padded to a multiple of it: sequence parallelism
    splits the sequence evenly). The default is one process."""

    dp_rank: int = 0
    dp_world: int = 1
    tensor: int = 1
    layout: str = "single device"  # the mesh, as the header says it (MeshShape.describe)

    @property
    def distributed(self) -> bool:
        return self.dp_world * self.tensor > 1

    def share(self, batches: Sequence[Item]) -> list[Optional[Item]]:
        """This rank's batches (every dp_world-th, from its coordinate), then None up to the number every
        rank runs: each None is a forward that keeps the collectives in step and scores nothing."""
        mine: list[Optional[Item]] = list(batches[self.dp_rank::self.dp_world])
        if not self.distributed:
            return mine
        import torch.distributed as dist

        # NCCL reduces device tensors only; gloo, host ones.
        count = torch.tensor([len(mine)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return mine + [None] * (int(count) - len(mine))

    def gather(self, scored: dict[int, Any]) -> dict[int, Any]:
        """Every rank's {request index: result}, merged (tensor ranks of a replica send the same entries)."""
        if not self.distributed:
            return scored
        import torch.distributed as dist

        parts: list[Optional[dict[int, Any]]] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, scored)
        return {k: v for part in parts for k, v in (part or {}).items()}

    def width(self, n: int) -> int:
        """A batch width of at least n tokens that the tensor-parallel degree divides."""
        return -(-n // self.tensor) * self.tensor


def eval_mesh_overrides(options: list[str]) -> dict[str, dict[str, int]]:
    """{"ici_mesh": {axis: degree}, "dcn_mesh": {...}} from `ici_mesh.AXIS=N` / `dcn_mesh.AXIS=N` items;
    an axis eval does not apply, or a degree that is not an integer, is one line."""
    meshes: dict[str, dict[str, int]] = {"ici_mesh": {}, "dcn_mesh": {}}
    for item in options:
        key, _, value = item.partition("=")
        section, _, axis = key.partition(".")
        if axis not in EVAL_AXES:
            raise ConfigError(f"'{key}': ember eval shards the model over {', '.join(EVAL_AXES)} "
                              f"({section}.data, {section}.fsdp, {section}.tensor); pipeline, context and expert "
                              "layouts are for training")
        try:
            meshes[section][axis] = int(value)
        except ValueError:
            raise ConfigError(f"{key} must be int, got '{value}'") from None
    return meshes


def eval_mesh_sections(meshes: dict[str, dict[str, int]]) -> tuple[MeshConfig, MeshConfig]:
    """(ici_mesh, dcn_mesh) as a run's config holds them: training's default (fsdp fills the world) with the
    given axes."""
    ici = dict(meshes["ici_mesh"])
    if "fsdp" not in ici and -1 not in (*ici.values(), *meshes["dcn_mesh"].values()):
        ici["fsdp"] = -1
    return MeshConfig(**ici), MeshConfig(**meshes["dcn_mesh"])


def eval_mesh_shape(meshes: dict[str, dict[str, int]], world_size: int) -> MeshShape:
    """The resolved MeshShape, checked against the world size as training checks it."""
    from ember.parallel.mesh_shape import MeshError, resolve_mesh

    try:
        return resolve_mesh(*eval_mesh_sections(meshes), world_size)
    except MeshError as err:
        raise ConfigError(str(err)) from None
