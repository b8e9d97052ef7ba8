"""A stage kind's tracked memory extended to any depth and micro-batch: the stage cut to a few layers
(`cut_stage`), tracked by memory.track_step at several layer counts and two row counts (`model_stage`), and
read back piecewise-affinely (`StageModel.at`), each region of the step on its own line (the peak is the largest:
it moves from one region to another with depth); remat=offload derived from full remat's runs (`offloaded`).

The counts are 3k and 4k layers (and fewer where a stage holds fewer), k a multiple of remat_every and of the MoE
period (moe_every, sparse_step) so every run sees whole periods, after the model's non-repeating first layers where
the stage holds them (DeepSeek's dense prefix). Blocks are alike, but the first few are not on one line: FSDP has up
to three blocks' weights or gradients unsharded at once (the one computing, the next one's all-gather issued ahead, the
last one's reduce-scatter in flight), so from three blocks on the peak is affine in the layer count, and a line
through one and two blocks would count the gathered neighbour once per layer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

from torch import nn

from ember.parallel.mesh import ParallelMesh
from ember.plan.memory import Tracked, build_parts, layer_period, layer_prefix, track_step
from ember.plan.trackers import REGIONS
from ember.train.run import RunSpec


def cut_stage(spec: RunSpec, mesh: Optional[ParallelMesh], kind: str, n_layers: int) -> nn.Module:
    """A stage of `kind` with `n_layers` layers: a model of 1, 2 or 3 such runs of layers, split as the
    pipeline splits (so the first keeps the embedding, the last the norm and output)."""
    runs, stage_id = {"whole": (1, 0), "first": (2, 0), "middle": (3, 1), "last": (2, 1)}[kind]
    args = dataclasses.replace(spec.args, n_layers=n_layers * runs)
    return build_parts(spec, mesh, [stage_id], args=args, num_stages=runs)[0]


@dataclass(frozen=True)
class StageModel:
    """Tracked peak, static and activation bytes of a stage kind, piecewise affine in layers between the tracked
    counts (extended past the largest from the last two) and affine in micro-batch rows:
    value(L, B) = v(L, B0) + (v(L, 2 B0) - v(L, B0)) (B - B0) / B0."""

    runs: dict[tuple[int, int], Tracked]
    grad_ratio: dict[str, float]  # see state_bytes

    def at(self, n_layers: float, batch: float) -> Tracked:
        """The peak is the largest of the regions' (memory.Tracked), each extended on its own: the step's own peak
        moves between regions with depth and rows, and a line through it would take one region's slope for all
        (Llama 3.1 405B at tensor=8: the gradients at the backward's end make the peak of a few layers, where 126
        layers peak on their activations; the line through the few let 8 sequences of 8192 tokens fit in 80 GB)."""
        counts = sorted({k for k, _ in self.runs})
        b_lo, b_hi = min(b for _, b in self.runs), max(b for _, b in self.runs)
        # the segment n_layers lies on: the last one starting at or below it (the first below the smallest count)
        i = max([j for j in range(len(counts) - 1) if counts[j] <= n_layers] or [0])
        k1, k2 = counts[i], counts[i + 1]

        def affine(value: Callable[[Tracked], int]) -> int:
            def in_layers(b: int) -> float:
                lo, hi = value(self.runs[(k1, b)]), value(self.runs[(k2, b)])
                return lo + (n_layers - k1) * (hi - lo) / (k2 - k1)
            if b_hi == b_lo:
                return round(in_layers(b_lo))
            lo, hi = in_layers(b_lo), in_layers(b_hi)
            return round(lo + (batch - b_lo) * (hi - lo) / (b_hi - b_lo))
        regions = tuple(affine(lambda t, r=r: t.regions[r]) for r in range(len(self.runs[(k1, b_lo)].regions)))
        peak = max(regions) if regions else affine(lambda t: t.peak)
        return Tracked(peak, affine(lambda t: t.static), affine(lambda t: t.activations), regions)


def offloaded(model: StageModel) -> StageModel:
    """`model` (tracked with remat=full) with each block's input in host memory, as remat=offload keeps it (the XLA
    path's offload policy, torch's save_on_cpu): full remat's activations grow per layer by exactly those inputs,
    so at every tracked count that growth is taken off the activations and off the peaks of the regions that hold
    them all. The host memory they fill is not planned."""
    k1, k2 = sorted({k for k, _ in model.runs})[-2:]  # the two deepest runs: past the first blocks' neighbours
    runs = {}
    for (k, rows), tracked in model.runs.items():
        per_layer = (model.runs[(k2, rows)].activations - model.runs[(k1, rows)].activations) / (k2 - k1)
        # the regions up to the backward's middle peak holding every block's input (at their start); the backward's
        # bottom and the optimizer hold at most one (and the middle's end is the bottom's start)
        regions = tuple(round(peak - k * per_layer) if REGIONS[r] in ("forward", "backward top", "backward middle")
                        else peak for r, peak in enumerate(tracked.regions))
        runs[(k, rows)] = Tracked(max(regions) if regions else round(tracked.peak - k * per_layer), tracked.static,
                                  round(tracked.activations - k * per_layer), regions)
    return StageModel(runs, model.grad_ratio)


def tracked_layer_counts(period: int, fewest_layers: float) -> tuple[int, ...]:
    """The layer counts a stage kind is tracked at: 3 and 4 periods, from which the peak is affine in the layer
    count, and below them down to the period count of the kind's smallest stage (or virtual stage), which the
    line from 3 and 4 would miss (see the module's docstring)."""
    first = min(3, max(1, int(fewest_layers // period)))
    return tuple(m * period for m in range(first, 5))


def model_stage(spec: RunSpec, mesh: Optional[ParallelMesh], kind: str, batch: int, both_batches: bool,
                fewest_layers: float) -> StageModel:
    """The tracked runs of a stage kind (see tracked_layer_counts; `fewest_layers`: the fewest any stage of this
    kind holds), and with `both_batches` at `batch` and 2 x `batch` rows per forward (for other micro-batch
    sizes)."""
    runs, grad_ratio = {}, {}
    # A stage holding the model's first layers tracks them whole (DeepSeek's dense prefix), so that the line through
    # the counts adds periods of the repeating layers: a line from a dense-only cut to one with a first MoE layer
    # would count that layer's one-off gathered experts once per layer.
    prefix = layer_prefix(spec) if kind in ("whole", "first") else 0
    for rows in ((batch, 2 * batch) if both_batches else (batch,)):
        for layers in (prefix + count for count in tracked_layer_counts(layer_period(spec), fewest_layers - prefix)):
            part = cut_stage(spec, mesh, kind, layers)
            runs[(layers, rows)] = track_step(spec, mesh, part, kind, rows, grad_ratio if not runs else None)
    return StageModel(runs, grad_ratio)
