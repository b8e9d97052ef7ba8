"""Eval on a mesh: `ember eval` under torchrun / `--nproc-per-node` with training's mesh keys.

The model is built on meta, parallelized by the same pipeline as training (FSDP2 over data x fsdp, Megatron TP
over tensor) and loaded sharded, so a model that fits no single device is evaluated where it was trained.
Requests are split over the data-parallel ranks in whole batches and the scores gathered on every rank; ranks
of one replica (tensor) score the same batches. FSDP and TP run collectives inside every forward, so every rank
runs the same number of forwards: a rank whose share is shorter runs a one-token forward per missing batch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, TypeVar

import torch
from torch import nn

from ember.config_schema import JobConfig, MeshConfig, ModelConfig, ParallelConfig
from ember.errors import ConfigError

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


def eval_mesh_shape(meshes: dict[str, dict[str, int]], world_size: int) -> Any:
    """The resolved MeshShape, checked against the world size as training checks it."""
    from ember.parallel.mesh_shape import MeshError, resolve_mesh

    try:
        return resolve_mesh(*eval_mesh_sections(meshes), world_size)
    except MeshError as err:
        raise ConfigError(str(err)) from None


def load_sharded(path: str, meshes: dict[str, dict[str, int]]) -> tuple[nn.Module, EvalRanks]:
    """Join the job (torchrun's environment), build the mesh, and load the model at `path` (an ember run or
    checkpoint, or an HF directory) sharded over it, built as training builds it (ember.run.build_model).
    Returns the model in eval mode and this rank's place."""
    from ember.hardware import pick_device
    from ember.load import source_architecture
    from ember.parallel.mesh import ParallelMesh, init_distributed
    from ember.run import build_model, resolve

    world_size = int(os.environ.get("WORLD_SIZE", 1))
    shape = eval_mesh_shape(meshes, world_size)
    if Path(path).is_file():
        raise ConfigError(f"'{path}' is a torch file, which loads on one process; evaluate it without a mesh, or "
                          f"`ember convert {path} CKPT` and evaluate CKPT")
    family, _, args, _ = source_architecture(path)
    tensor = shape.degree("tensor")
    if tensor > 1 and (args.n_heads % tensor or args.kv_heads % tensor):
        raise ConfigError(f"ici_mesh.tensor={tensor} must divide the model's {args.n_heads} heads and {args.kv_heads} "
                          "KV heads; choose a tensor degree that divides both")
    ici, dcn = eval_mesh_sections(meshes)
    # The stored weights as they are (fp32, no FSDP mixed precision), and logits whole on every rank
    # (no loss_parallel): scoring reads them like one process's.
    cfg = JobConfig(model=ModelConfig(family=family, init_from=str(path)), ici_mesh=ici, dcn_mesh=dcn,
                    precision="fp32", global_batch_size=world_size, micro_batch_size=1,
                    parallel=ParallelConfig(loss_parallel=False, mixed_precision=False))
    device = pick_device("auto")
    spec = resolve(cfg, world_size, device)
    init_distributed(device, timeout_s=600)
    mesh = ParallelMesh(shape, device.type)
    model = build_model(spec, mesh, random_init=False).parts[0]
    return model.eval(), EvalRanks(mesh.dp_rank, shape.dp, tensor, shape.describe())
