"""Pipeline parallelism with torch.distributed.pipelining: split by layer name, build the schedule.

The model is cut into pipeline stages by module name (its layers are a ModuleDict keyed by index, and
tok_embeddings / norm / output may be None), so a stage is the same Transformer class holding a
contiguous run of layers: the first stage keeps the embedding, the last the norm and output.
"""

from __future__ import annotations

import copy
from typing import Callable, Union

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


def stage_layer_ranges(n_layers: int, num_stages: int) -> list[range]:
    """Contiguous, as-even-as-possible runs of layer indices, one per stage (earlier stages get the extra
    layers; the last stage also carries the output projection)."""
    bounds = [round(i * n_layers / num_stages) for i in range(num_stages + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(num_stages)]


def stage_ids(pp_rank: int, pp_size: int, stages_per_rank: int) -> list[int]:
    """The stages this rank runs: looped assignment (rank r: r, r + pp, ...), what interleaved 1F1B expects."""
    return [pp_rank + k * pp_size for k in range(stages_per_rank)]


def split_model(model: nn.Module, stage_id: int, num_stages: int) -> nn.Module:
    """A copy of `model` (on meta) that keeps only stage `stage_id`'s layers and pieces."""
    stage = copy.deepcopy(model)
    keep = {str(i) for i in stage_layer_ranges(len(model.layers), num_stages)[stage_id]}
    for name in list(stage.layers.keys()):
        if name not in keep:
            del stage.layers[name]
    if stage_id != 0:
        stage.tok_embeddings = None
        stage.pos_embeddings = None  # learned positions (GPT) go with the token embedding
    if stage_id != num_stages - 1:
        stage.norm = None
        stage.output = None
    return stage


def build_schedule(
    stage_modules: list[tuple[int, nn.Module]],
    num_stages: int,
    device: torch.device,
    pp_mesh: DeviceMesh,
    schedule: str,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Union[PipelineScheduleSingle, PipelineScheduleMulti]:
    """The pipeline schedule over this rank's stages. Gradients are not rescaled by the schedule
    (scale_grads=False): loss_fn already divides by the global batch's token count."""
    group = pp_mesh.get_group()
    stages = [PipelineStage(module, sid, num_stages, device, group=group) for sid, module in stage_modules]
    cls = SCHEDULES[schedule]
    if schedule == "interleaved_1f1b":
        return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
