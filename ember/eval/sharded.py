"""The model of a distributed `ember eval`: built on the mesh by ember.train.run.build_model, as training builds it,
and loaded sharded from the run, checkpoint or HF directory (ember/eval/distributed.py says how requests are
shared out)."""

from __future__ import annotations

import os
from pathlib import Path

from torch import nn

from ember.config_schema import JobConfig, ModelConfig, ParallelConfig
from ember.errors import ConfigError
from ember.eval.distributed import EvalRanks, eval_mesh_sections, eval_mesh_shape
from ember.hardware.device import pick_device
from ember.model_io.load import source_architecture
from ember.parallel.mesh import ParallelMesh, init_distributed
from ember.train.run import build_model, resolve


def load_sharded(path: str, meshes: dict[str, dict[str, int]]) -> tuple[nn.Module, EvalRanks]:
    """Join the job (torchrun's environment), build the mesh, and load the model at `path` (an ember run or
    checkpoint, or an HF directory) sharded over it, built as training builds it (ember.train.run.build_model).
    Returns the model in eval mode and this rank's place."""
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
