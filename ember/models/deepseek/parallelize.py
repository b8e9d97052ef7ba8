"""DeepSeek's tensor-parallel plan: Llama's residual stream, norms and dense FFN (ember/models/llama/parallelize.py),
with MLA's heads split. The per-head projections (wq or wq_b, wkv_b) are column-wise and wo row-wise; the latent
projections (wq_a, wkv_a) and their norms are replicated: every rank computes them on the gathered sequence, and
the column-wise layers' input all-reduces the latents' gradients over the ranks' heads. The one exception is kv_a's
rope columns, the key shared by every head, which reaches attention without passing a column-wise layer: its
gradient, each rank's heads' share, is summed over the ranks (`MLAInput`). Experts, the router and the
shared expert run replicated on each rank's sequence shard (ember/parallel/parallelize.py's MoE entry), as Qwen's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from ember.models.llama.parallelize import tp_plan as llama_tp_plan


class _SumRopeGradient(torch.autograd.Function):
    """Identity forward; backward sums the last `width` columns of the gradient over the tensor-parallel group."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, width: int, group: Any) -> torch.Tensor:
        ctx.width, ctx.group = width, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.clone()
        rope = grad[..., -ctx.width:].contiguous()
        dist.all_reduce(rope, group=ctx.group)
        grad[..., -ctx.width:] = rope
        return grad, None, None


class MLAInput(PrepareModuleInput):
    """The attention's input gathered from sequence shards and handed over as a local tensor (the replicated latent
    projections are plain nn.Linear; the column-wise ones take it as Replicate), and a hook on its wkv_a whose
    output's last rope_dim columns, the rope key shared by every head, get their gradient summed over the ranks
    (each computed it for its own heads only)."""

    def __init__(self) -> None:
        super().__init__(input_layouts=(Shard(1), None, None, None),
                         desired_input_layouts=(Replicate(), None, None, None), use_local_output=True)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group, width = device_mesh.get_group(), module.rope_dim
        module.wkv_a.register_forward_hook(lambda _m, _i, out: _SumRopeGradient.apply(out, width, group))
        return super()._apply(module, device_mesh)


def tp_plan(loss_parallel: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model-level plan, per-block plan) for DeepSeek-V3 and V2."""
    top, llama_block = llama_tp_plan(loss_parallel)
    block = {k: v for k, v in llama_block.items() if not k.startswith("attention")}
    block.update({
        "attention": MLAInput(),
        "attention.wq": ColwiseParallel(),
        "attention.wq_b": ColwiseParallel(),
        "attention.wkv_b": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    })
    return top, block
