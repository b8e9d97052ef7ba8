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
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
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
    """MLA's input gathered from sequence shards and handed over as a local tensor (the column-wise layers take it as
    Replicate), and its latent projections and norms (wq_a, q_norm, wkv_a, kv_norm) replicated: Replicate DTensor
    weights (the optimizer and FSDP see one kind of parameter) running on local tensors in and out. wkv_a's last
    rope_dim output columns, the rope key shared by every head, get their gradient summed over the ranks (each
    computed it for its own heads only); its latent columns' gradient arrives summed through wkv_b."""

    def __init__(self) -> None:
        super().__init__(input_layouts=(Shard(1), None, None, None),
                         desired_input_layouts=(Replicate(), None, None, None), use_local_output=True)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group, width = device_mesh.get_group(), module.rope_dim

        def as_replicate(_m: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)

        for name in ("wq_a", "q_norm", "wkv_a", "kv_norm"):
            latent = getattr(module, name, None)
            if latent is None:  # no q latent (V2-Lite)
                continue
            if name == "wkv_a":
                local = lambda _m, out, _mesh: _SumRopeGradient.apply(out.to_local(), width, group)  # noqa: E731
            else:
                local = lambda _m, out, _mesh: out.to_local()  # noqa: E731
            distribute_module(latent, device_mesh, input_fn=as_replicate, output_fn=local)
        return super()._apply(module, device_mesh)


def tp_plan(loss_parallel: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model-level plan, per-block plan) for DeepSeek-V3 and V2."""
    top, llama_block = llama_tp_plan(loss_parallel)
    block = {k: v for k, v in llama_block.items() if k != "attention" and not k.startswith("attention.")}
    block.update({
        "attention": MLAInput(),
        "attention.wq": ColwiseParallel(),
        "attention.wq_b": ColwiseParallel(),
        "attention.wkv_b": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    })
    return top, block
