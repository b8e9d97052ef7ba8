"""torch's memory trackers as the plan and its measurements run them over one training step: every tensor storage
alive at every op, by category (`MemTracker`; `FSDPMemTracker` for FSDP modules), with what they miscount fixed
here: a root module's several forwards per step, parameters FSDP leaves alone, and DTensor's sharding
propagation under fake tensors; and the peak of each region of the step, for the plan's extrapolation in depth."""

from __future__ import annotations

import contextlib
import copy
import re
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed._tools.mem_tracker import MemTracker


class _ShardingPropagation:
    """How deep this thread is in DTensor's sharding propagation (see untracked_sharding_propagation)."""

    depth = 0


@contextlib.contextmanager
def untracked_sharding_propagation() -> Iterator[None]:
    """DTensor works out an op's output shape by running it on empty tensors of the *global* shapes in the fake
    mode it finds active: under the plan's FakeTensorMode that is the tracked one, so torch's trackers counted
    them (their own check skips them only when the step runs outside fake mode, as the measured one does). An
    expert-parallel gradient accumulation allocated every rank's experts at once, and only on the first of each
    op signature (DTensor caches the result): the first tracked layer count ran gigabytes over the next, and the
    line through them fell with depth (Mixtral 8x7B at expert=8: a negative peak). Marks the propagation, so that
    the trackers (_StepTracking) leave it out."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    real = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self: ShardingPropagator, op_schema: Any) -> Any:
        _ShardingPropagation.depth += 1
        try:
            return real(self, op_schema)
        finally:
            _ShardingPropagation.depth -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = real


REGIONS = ("forward", "backward top", "backward middle", "backward bottom", "optimizer")
_LAYER = re.compile(r"\.layers\.(\d+)$")


class _StepTracking:
    """What the plan's trackers add to torch's: DTensor's sharding propagation left out (metadata, no memory of the
    step: see untracked_sharding_propagation), the step's peak kept without each module's own, and with `watch` the
    peak of each region of the step (REGIONS): the forwards; the backward through the head and the part's last layer,
    through its middle layers, through its first layer and the embedding; the optimizer. The step's peak moves between
    regions as layers are added (at a few layers the embedding's and the output's gradients can outweigh the
    activations, which every layer adds to), so it is not affine in the layer count; each region's peak stays where it
    is (ember/plan/stages.py)."""

    layer_range: Optional[tuple[int, int]] = None

    def watch(self, layers: Iterable[int]) -> None:
        """Record the regions' peaks of a part holding `layers` (their indices)."""
        indices = sorted(layers)
        self.layer_range = (indices[0], indices[-1]) if indices else (0, 0)
        self.region_peaks = dict.fromkeys(REGIONS, 0)
        self._at = 0  # REGIONS' index the micro-batch has reached (a backward only moves down the layers)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if _ShardingPropagation.depth:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)  # type: ignore[misc]

    def _update_peak_stats(self, peak_state: Any) -> None:
        # The step's peak, as torch's does it, without torch's per-module peaks: those copy the snapshot into each
        # running module's stats at every op that raises them, and nothing here reads them
        for dev, snap in self._curr_mem_snap.items():  # type: ignore[attr-defined]
            if self._peak_mem.get(dev, 0) < snap["Total"]:  # type: ignore[attr-defined]
                self._peak_mem[dev] = snap["Total"]  # type: ignore[attr-defined]
                self._peak_mem_snap[dev] = copy.deepcopy(snap)  # type: ignore[attr-defined]
        if self.layer_range is not None:
            region = REGIONS[self._region()]
            total = total_bytes(self._curr_mem_snap)  # type: ignore[attr-defined]
            self.region_peaks[region] = max(self.region_peaks[region], total)

    def _region(self) -> int:
        if self._in_opt:  # type: ignore[attr-defined]
            return 4
        parents = self._mod_tracker.parents  # type: ignore[attr-defined]
        if not self._mod_tracker.is_bw:  # type: ignore[attr-defined]
            if parents != {"Global"}:  # a module's forward (the loss after it, outside modules, is the forward's too)
                self._at = 0
            return self._at  # or the backward's end: FSDP's last reductions run once autograd's engine is done
        self._at = max(self._at, 1)
        running = [int(m[1]) for name in parents if (m := _LAYER.search(name))]
        if running:  # ops between layers (hooks, reductions) stay with the layer before
            first, last = self.layer_range
            layer = min(running)
            self._at = max(self._at, 1 if layer == last else 3 if layer == first else 2)
        return self._at


def fsdp_step_tracker(part: nn.Module, optimizer: torch.optim.Optimizer) -> MemTracker:
    """torch's FSDPMemTracker for a step of `part` (an FSDP module). It counts FSDP's own parameters from the
    start and any other tensor only once an op outputs it: the parameters FSDP leaves alone (experts whose
    expert axis is the only data axis, fsdp=1) appeared at their first use in the forward, as activations, and
    were missing from the bytes held before it. They are registered here as parameters."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType

    class FSDPStepTracker(_StepTracking, FSDPMemTracker):
        pass

    tracker = FSDPStepTracker(part, optimizer)
    for p in part.parameters():  # FSDP's own are registered again, with the same type, when the tracker starts
        tracker._update_and_maybe_create_winfos(p, _FSDPRefType.SHARDED_PARAM)
    return tracker


def step_memory_tracker() -> MemTracker:
    """torch's MemTracker for a whole training step. It raises when the root module runs a second forward
    (meant to catch a second iteration), which gradient accumulation and pipeline micro-batches do within
    one step: a root module's stats start over at each of its forwards. The totals (what the plan uses) are
    kept per storage and are not touched."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepMemTracker(_StepTracking, MemTracker):
        def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
            name = self._mod_tracker.get_known_fqn(module)
            if (module in self.memory_tracking and not self._mod_tracker.is_bw
                    and set(self._mod_tracker.parents) - {name} == {"Global"}):
                del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

        def _track_module_params_and_buffers(self, module: nn.Module,
                                             install_grad_hooks: bool = True) -> tuple[int, int]:
            # torch's tracker hooks every parameter's gradient, which raises on a frozen one (LoRA's base); the
            # hooks only label gradient bytes as such, the totals are counted per storage either way
            frozen = any(not p.requires_grad for p in module.parameters())
            return super()._track_module_params_and_buffers(module, install_grad_hooks and not frozen)

    return StepMemTracker()


def total_bytes(snapshot: dict) -> int:
    """A MemTracker snapshot's bytes over every device."""
    return sum(dev.get("Total", 0) for dev in snapshot.values())
