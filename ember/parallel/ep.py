"""Expert parallelism: each rank of the `expert` axis holds E / ep of every MoE layer's experts, and
tokens travel to the rank of their expert and back by all-to-all (GShard, Lepikhin et al. 2020; the
same dispatch as torchtitan's ExpertParallel and Megatron-LM's alltoall token dispatcher).

Expert ranks read batches of their own (the expert axis is a data axis for everything else), so the
non-expert parameters are sharded and reduced over it by FSDP, while each expert's gradient is
complete on its one rank: the all-to-all's backward brings every rank's token gradients home.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor


def apply_ep(moe_layers: list[nn.Module], ep_mesh: DeviceMesh) -> None:
    """Shard each MoE layer's experts over `ep_mesh` (Shard(0) over the expert dimension: rank r holds
    experts r*E/ep .. (r+1)*E/ep - 1). Works on a model built on meta (shapes only), before to_empty and init.
    The layers route their tokens through `expert_dispatch(ep_mesh)`, which build_model gave them at
    construction (ember/train/run.py)."""
    ep = ep_mesh.size()
    for moe in moe_layers:
        if moe.n_experts % ep:
            raise ValueError(f"expert-parallel degree {ep} does not divide the {moe.n_experts} experts of a MoE "
                             f"layer; choose an expert degree that divides model.n_experts")
        if not isinstance(moe.dispatch, AllToAllDispatch):
            raise ValueError("a MoE layer sharded over the expert axis must be built with expert_dispatch(ep_mesh)")
        for name, param in list(moe.experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)])
            moe.experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))


def expert_dispatch(ep_mesh: Optional[DeviceMesh]) -> Optional[AllToAllDispatch]:
    """The MoE layers' dispatch over `ep_mesh` (None: no expert axis, every expert is on this rank)."""
    return AllToAllDispatch(ep_mesh.get_group(), ep_mesh.size()) if ep_mesh is not None else None


def expert_params(moe_layers: list[nn.Module]) -> set[nn.Parameter]:
    return {p for moe in moe_layers for p in moe.experts.parameters()}


class AllToAllDispatch:
    """(experts, tokens sorted by expert, tokens per expert (E,), the Experts module) -> the experts' outputs, same
    order (nn/moe_stats.Dispatch; `experts` runs the local ones, so the module itself is not needed).

    1. Exchange the per-expert counts, so every rank knows how many tokens it receives for each of its
       experts from each rank (a small all-to-all, then one host sync: the split sizes must be known).
    2. all-to-all the tokens: what arrives is ordered (source rank, local expert); regroup it by local
       expert, run the local experts, restore the arrival order.
    3. all-to-all the outputs back. Both token all-to-alls are differentiable (functional collectives),
       so backward sends the gradients the same way in reverse.
    """

    def __init__(self, group: dist.ProcessGroup, ep: int):
        self.group, self.ep = group, ep

    def __call__(self, experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x_sorted: torch.Tensor,
                 counts: torch.Tensor, module: Optional[nn.Module] = None) -> torch.Tensor:
        n_local = counts.numel() // self.ep
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # (ep * n_local,): [source][local expert]
        received = received.view(self.ep, n_local)  # tokens from each source rank for each local expert
        send_splits = counts.view(self.ep, n_local).sum(dim=1).tolist()  # to each rank (its experts' share)
        recv_splits = received.sum(dim=1).tolist()
        x_recv = all_to_all_single_autograd(x_sorted, recv_splits, send_splits, self.group)  # (M_recv, dim)
        # Arrival order is (source, expert); the experts want (expert, source): a stable sort by expert.
        expert_of_row = torch.arange(n_local, device=counts.device).repeat(self.ep).repeat_interleave(
            received.flatten())
        by_expert = torch.argsort(expert_of_row, stable=True)
        out_local = experts(x_recv[by_expert], received.sum(dim=0))  # (M_recv, dim), expert-major
        out_recv = torch.empty_like(out_local).index_copy(0, by_expert, out_local)  # back to arrival order
        return all_to_all_single_autograd(out_recv, send_splits, recv_splits, self.group)  # (M, dim)
