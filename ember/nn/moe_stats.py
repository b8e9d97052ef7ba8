"""What a run gives its MoE layers at construction (`MoEOptions`: router-loss weights, how experts are reached,
where statistics go) and the statistics collector the training engine owns (`MoEStats`).

A MoE layer keeps no training state of its own: each forward hands its router losses and expert load to the
collector it was built with (none: nothing is kept, as for eval, generation and reference models). The engine
reads them back from the collector: the step's load (`end_step`, or `record_step` for loads computed outside
the layers), DeepSeek-V3's bias update (`update_score_bias`) and the logging window's metrics
(`collect_metrics`). Nothing here knows torch.distributed: reductions come in as an `all_sum` callable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

# (run_experts, tokens sorted by expert, counts (E,), experts) -> the experts' outputs in the same order;
# run_experts(tokens, counts) runs the layer's own experts on this process. Expert parallelism's all-to-all
# (ember/parallel/ep.py) and the XLA step's ragged_dot (ember/xla/step.py) are such callables.
Dispatch = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class RouterLoss:
    """The router losses' weights in the objective: it gains aux_coef * aux_loss + z_coef * z_loss of each
    training forward, times `weight_per_token` x the tokens that forward routed. Zero coefficients: no
    router loss reaches the gradient (the losses are still computed for the metrics)."""

    aux_coef: float = 0.0
    z_coef: float = 0.0
    weight_per_token: float = 0.0

    @classmethod
    def for_step(cls, aux_coef: float, z_coef: float, tokens_per_step: int, n_moe_layers: int) -> RouterLoss:
        """coef x the losses' mean over the whole model's `n_moe_layers` and the step's `tokens_per_step` routed
        tokens. Weighing each forward by the tokens it routed makes that hold in every layout: data, expert and
        pipeline micro-batches, and the sequence shards of tensor and context ranks."""
        return cls(aux_coef, z_coef, 1.0 / (tokens_per_step * max(n_moe_layers, 1)))

    @property
    def active(self) -> bool:
        return bool(self.aux_coef or self.z_coef)


@dataclass(frozen=True)
class MoEOptions:
    """A MoE layer's construction options that come from the run, not the architecture (ember/train/run.py's
    build_model passes them to the families' MoE layers)."""

    router_loss: RouterLoss = RouterLoss()
    dispatch: Optional[Dispatch] = None  # None: every expert is on this process
    stats: Optional[MoEStats] = None  # None: the forwards' statistics are not kept

    def __deepcopy__(self, memo: dict) -> MoEOptions:
        # The run's, shared by every copy of a model: a pipeline stage (a deep copy, parallel/pp.py) reports to
        # the engine's collector and dispatches over the job's process group, never a copy of either.
        return self


@dataclass
class LayerStats:
    """One MoE layer's statistics in a collector."""

    aux_loss: Optional[torch.Tensor] = None  # the latest forward's load-balancing loss
    z_loss: Optional[torch.Tensor] = None  # the latest forward's router z-loss
    tokens_per_expert: Optional[torch.Tensor] = None  # the latest forward's load (E,)
    loads: list[torch.Tensor] = field(default_factory=list)  # tokens per expert of each training forward this step
    step_load: Optional[torch.Tensor] = None  # (E,) fp64, the last step's (what update_score_bias reads)
    window_load: Optional[torch.Tensor] = None  # (E,) fp64, summed over steps until collected


class MoEStats:
    """The MoE layers' statistics of one model (or of this rank's pipeline stages), keyed by layer.

    keep_graph: the router losses are kept differentiable (the XLA step adds them to its objective from here);
    otherwise they are kept as values, since a graph would hold the forward's activations (under activation
    checkpointing, every MoE block's recomputed ones) until the next forward."""

    def __init__(self, keep_graph: bool = False):
        self.keep_graph = keep_graph
        self.layers: dict[nn.Module, LayerStats] = {}

    def of(self, layer: nn.Module) -> LayerStats:
        """`layer`'s statistics (empty until its first forward)."""
        return self.layers.setdefault(layer, LayerStats())

    def observe(self, layer: nn.Module, aux_loss: torch.Tensor, z_loss: torch.Tensor, counts: torch.Tensor,
                training: bool) -> None:
        """A forward of `layer`: its router losses and load; `training`: a training forward (not a recompute
        under activation checkpointing), whose load counts toward the step."""
        stats = self.of(layer)
        stats.aux_loss = aux_loss if self.keep_graph else aux_loss.detach()
        stats.z_loss = z_loss if self.keep_graph else z_loss.detach()
        stats.tokens_per_expert = counts.detach()
        if training:
            stats.loads.append(stats.tokens_per_expert)

    def take(self, module: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(aux_loss, z_loss, tokens_per_expert) of each MoE layer in `module` after its forward, in module order,
        and its step loads cleared: the XLA step's trace values, which a jax.checkpoint or scan returns as outputs."""
        taken = []
        for layer in module.modules():
            stats = self.layers.get(layer)
            if stats is not None and stats.aux_loss is not None:
                taken.append((stats.aux_loss, stats.z_loss, stats.tokens_per_expert))
                stats.loads.clear()
        return taken

    def put(self, module: nn.Module, taken: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        """`take`'s values back as the latest of `module`'s MoE layers (in module order)."""
        layers = [m for m in module.modules() if m in self.layers]
        for layer, (aux, z, counts) in zip(layers, taken):
            stats = self.layers[layer]
            stats.aux_loss, stats.z_loss, stats.tokens_per_expert = aux, z, counts

    def end_step(self, forwards_per_layer: int) -> None:
        """Add this step's load to each layer's logging window, from its last `forwards_per_layer` training
        forwards (a step's micro-batches, times the pipeline's): torch's pipeline stages run one more forward on
        their first step, on placeholder inputs to infer shapes, which is no load."""
        for stats in self.layers.values():
            if stats.loads:
                step = torch.stack(stats.loads[-forwards_per_layer:]).sum(0).double()
                stats.step_load = step
                stats.window_load = step if stats.window_load is None else stats.window_load + step
                stats.loads.clear()

    def record_step(self, layers: list[nn.Module], counts: Any, aux: Any) -> None:
        """A step's expert loads (layers x experts) and router losses (layers x [aux, z]) computed outside the
        layers (the XLA engine's compiled step returns them), taken as each layer's one training forward."""
        for layer, count, (aux_loss, z_loss) in zip(layers, counts, aux):
            stats = self.of(layer)
            stats.loads = [torch.as_tensor(count, dtype=torch.int64)]
            stats.aux_loss, stats.z_loss = torch.tensor(float(aux_loss)), torch.tensor(float(z_loss))
        self.end_step(1)

    def _walk(self, model_parts: list[nn.Module]) -> list[tuple[int, nn.Module, LayerStats]]:
        """(layer index, MoE layer, its statistics) of the parts' blocks, numbered as in the whole model (the
        blocks' keys), in the order the sums below always took."""
        return [(int(name), layer, self.layers[layer]) for part in model_parts for name, block in part.layers.items()
                for layer in block.modules() if layer in self.layers]

    @torch.no_grad()
    def update_score_bias(self, model_parts: list[nn.Module], rate: float, n_layers: int, n_experts: int,
                          all_sum: Callable[[torch.Tensor], torch.Tensor], device: torch.device) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing, after an optimizer step: each router's score bias moves by
        `rate` for every expert, up where the expert got fewer tokens than the mean over experts this step, down
        where it got more (sign(mean - load), the paper's rule). The load is summed over every rank first (one
        `all_sum`: every rank calls it, a pipeline stage without such routers too), so all replicas keep one bias."""
        load = torch.zeros(n_layers, n_experts, device=device, dtype=torch.float64)
        routers = []
        for index, layer, stats in self._walk(model_parts):
            if layer.router.score_bias is not None and stats.step_load is not None:
                load[index] += stats.step_load
                routers.append((index, layer.router))
        load = all_sum(load)
        for index, router in routers:
            tokens = load[index]
            router.score_bias += (rate * torch.sign(tokens.mean() - tokens)).to(router.score_bias.dtype)

    def collect_metrics(self, model_parts: list[nn.Module], n_layers: int, n_experts: int,
                        all_sum: Callable[[torch.Tensor], torch.Tensor], device: torch.device) -> dict[str, Any]:
        """The MoE metrics of the logging window, over every rank; resets the window. Every rank must call it
        (one `all_sum`), a pipeline stage without MoE layers too.
        - `aux_loss`, `z_loss`: the latest forward's router losses, averaged over every rank's MoE layers;
        - per MoE layer i: `moe/layer{i}/tokens_per_expert` (a list) and `moe/layer{i}/imbalance` (max over
          mean tokens per expert, 1.0 when balanced); `expert_imbalance`, their mean over layers."""
        # (layers, experts) loads and three router sums in one fp64 tensor: counts stay exact when summed.
        totals = torch.zeros(n_layers * n_experts + 3, device=device, dtype=torch.float64)
        load = totals[:-3].view(n_layers, n_experts)
        for index, _, stats in self._walk(model_parts):
            if stats.window_load is not None:
                load[index] += stats.window_load
                stats.window_load = None
            if stats.aux_loss is not None:
                totals[-3:] += torch.stack([stats.aux_loss.detach().double(), stats.z_loss.detach().double(),
                                            torch.ones((), device=device, dtype=torch.float64)])
        totals = all_sum(totals)
        load = totals[:-3].view(n_layers, n_experts)
        record: dict[str, Any] = {}
        if totals[-1] > 0:  # layers that reported router losses, over all ranks
            record["aux_loss"], record["z_loss"] = float(totals[-3] / totals[-1]), float(totals[-2] / totals[-1])
        imbalances = []
        for i, tokens in enumerate(load):
            if not tokens.any():
                continue  # a dense layer (GLaM alternates dense and MoE layers)
            imbalance = float(tokens.max() / tokens.mean())
            record[f"moe/layer{i}/tokens_per_expert"] = [int(n) for n in tokens.tolist()]
            record[f"moe/layer{i}/imbalance"] = imbalance
            imbalances.append(imbalance)
        if imbalances:
            record["expert_imbalance"] = sum(imbalances) / len(imbalances)
        return record
