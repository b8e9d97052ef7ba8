"""Per-rank memory of a job, on one CPU: the real sharding, and the real step under fake tensors.

Parameters, gradients and optimizer state come from the job's own build (model on meta -> pipeline split ->
`parallelize`) on a DeviceMesh over torch's fake process group (`init_process_group("fake")`: every
collective returns at once, so any rank of any world size can be built alone): the bytes are those of the
DTensor shards this rank holds, exactly.

Activations and the peak come from torch's memory trackers (`FSDPMemTracker`, `MemTracker`: every tensor
storage alive at every op, by category; ember/plan/trackers.py) over one training step of fake tensors
(`FakeTensorMode`: shapes and dtypes, no data, no FLOPs). Parallelizing inside fake mode fails (torch 2.13), so the
model is parallelized on meta first and `to_empty` runs inside fake mode. The tracked model is the rank's stage cut to a
few layers, extended to its depth by ember/plan/stages.py.
Pipeline stages are tracked as torch's schedules run them: FSDP without gradient sync or resharding until the
last backward (see track_step). Under fake tensors the MoE router's per-expert counts have no values (the
looped experts split their tokens by them on the host), so the plan routes every expert the same share of
tokens (balanced).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from ember.config_schema import JobConfig
from ember.nn.loss import blocks_sized_for
from ember.parallel.mesh import AXES, ParallelMesh, rank_grid
from ember.parallel.mesh_shape import MeshShape
from ember.plan.trackers import fsdp_step_tracker, step_memory_tracker, total_bytes, untracked_sharding_propagation
from ember.train.optim import build_optimizer
from ember.train.run import RunSpec, build_model, resolve, respecify
from ember.train.step import ForwardBackward, token_loss_sum

if TYPE_CHECKING:
    from torch.distributed._tools.mem_tracker import MemTracker

ADAM_MOMENTS = 2  # AdamW's exp_avg and exp_avg_sq, each like its parameter
STEP_BYTES = 4  # AdamW's per-parameter `step`: a float32 scalar tensor with the fused kernel (ember's default)


def plan_spec(cfg: JobConfig, world: int, device_type: str, compute_dtype: torch.dtype) -> RunSpec:
    """The run the plan models: ember.train.run.resolve's RunSpec for `world` devices of `device_type` ("cuda" for
    the accelerators in the plan's table, or "cpu") computing in the planner's `compute_dtype`."""
    return resolve(cfg, world, torch.device(device_type), compute_dtype=compute_dtype)


def with_micro_batch(spec: RunSpec, micro_batch_size: int, remat: Optional[str] = None) -> RunSpec:
    """`spec` at another micro-batch size (and remat policy): a trial of the planner's search."""
    cfg = dataclasses.replace(spec.cfg, micro_batch_size=micro_batch_size,
                              model=dataclasses.replace(spec.cfg.model, remat=remat or spec.cfg.model.remat))
    return respecify(spec, cfg)


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """This process as rank `rank` of `world_size` over torch's fake process group, for the duration."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("ember plan builds ranks over a fake process group; run it outside a distributed job")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _clear_dtensor_caches()


def _clear_dtensor_caches() -> None:
    """DTensor caches sharding decisions by mesh, and a DeviceMesh of the next fake world compares equal to
    this one's (same ranks, same names): its cached results would name this world's process groups, gone
    once it is destroyed ("Could not resolve the process group"). torch has no public way to clear them."""
    from torch.distributed.tensor import DTensor, _redistribute
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    for clear in (getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None),
                  getattr(DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding, "cache_clear", None),
                  getattr(ShardingPropagator._propagate_tensor_meta_cached, "cache_clear", None),
                  getattr(_redistribute, "clear_redistribute_planner_cache", None),
                  getattr(_redistribute._gen_transform_infos, "cache_clear", None)):
        if clear is not None:
            clear()


def build_parts(spec: RunSpec, mesh: Optional[ParallelMesh], stage_ids: list[int], args: Any = None,
                num_stages: Optional[int] = None) -> list[nn.Module]:
    """This rank's model parts on meta, split and parallelized by ember.train.run.build_model as the trainer builds
    them, LoRA included (frozen matrices, in bf16 under bf16 compute, and the adapters). Less what changes no
    byte the plan counts and has no fake-tensor or CPU form: compile, ring and flex attention, float8 linears,
    CPU offload (the planner prices FP8's matmuls and CP's traffic itself)."""
    counted = dataclasses.replace(spec.parallel, compile=False, cp_impl="allgather", flex_attention=False,
                                  fp8_recipe=None, cpu_offload=False)
    built = build_model(dataclasses.replace(spec, parallel=counted), mesh, stage_ids=stage_ids, args=args,
                        num_stages=num_stages, materialize=False)
    return built.parts


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def sharded_dims(p: torch.Tensor) -> list[tuple[str, int, int]]:
    """(mesh dimension name, its size, the tensor dimension) for each mesh dimension `p` is sharded over;
    FSDP over TP's Shard(0) shows as a _StridedShard, which is no Shard subclass and says is_shard() False."""
    if not hasattr(p, "placements"):
        return []
    mesh = p.device_mesh
    return [(mesh.mesh_dim_names[i], mesh.size(i), pl.dim) for i, pl in enumerate(p.placements)
            if pl.is_shard() or type(pl).__name__ == "_StridedShard"]


def named_params(parts: list[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of this rank's parts, each shared parameter once."""
    seen: dict[int, tuple[str, nn.Parameter]] = {}
    for part in parts:
        for name, p in part.named_parameters():
            seen.setdefault(id(p), (name, p))
    return list(seen.values())


def param_key(name: str, period: int) -> str:
    """A parameter's name with its layer index taken modulo the layer period: a cut stage's layer holds the
    same parameters as every layer of the whole stage at the same place in the period."""
    return re.sub(r"^layers\.(\d+)\.", lambda m: f"layers.{int(m[1]) % period}.", name)


@dataclass(frozen=True)
class StateBytes:
    """This rank's bytes of parameters, gradients and AdamW state (the shards it holds)."""

    param: int
    grad: int
    optim: int
    even: bool  # every sharded dimension divides evenly: every rank of the stage holds the same bytes


def state_bytes(params: list[tuple[str, nn.Parameter]], grad_ratio: Optional[dict[str, float]] = None,
                period: int = 1, on: Optional[tuple[MeshShape, int]] = None) -> StateBytes:
    """AdamW keeps two moments like each trainable parameter and a float32 step. A gradient is as large as
    its parameter's shard (FSDP reduces into the sharded parameter's dtype) unless the tracked step saw
    otherwise: `grad_ratio`, gradient over parameter bytes by param_key (under tensor parallelism without
    FSDP the embedding's gradient comes back replicated: the whole table on every tensor rank). `on` (mesh shape,
    rank): the shards that rank holds of the same parameters (built on another rank of that mesh; see local_numel)."""
    at = _coordinate(*on) if on is not None else None
    param = grad = optim = 0
    even = True
    for name, p in params:
        numel = local_numel(p, at)
        nbytes = numel * _local(p).element_size()
        param += nbytes
        if p.requires_grad:
            grad += round(nbytes * (grad_ratio or {}).get(param_key(name, period), 1.0))
            optim += ADAM_MOMENTS * nbytes + STEP_BYTES
        even &= numel * math.prod(size for _, size, _ in sharded_dims(p)) == p.numel()
    return StateBytes(param, grad, optim, even)


def _coordinate(shape: MeshShape, rank: int) -> dict[str, tuple[int, int]]:
    """(index, degree) of `rank` along each mesh axis."""
    where = (rank_grid(shape, AXES) == rank).nonzero()[0].tolist()
    return {axis: (index, shape.degree(axis)) for axis, index in zip(AXES, where)}


def local_numel(p: torch.Tensor, at: Optional[dict[str, tuple[int, int]]] = None) -> int:
    """Elements of this rank's shard of `p`, or with `at` (_coordinate) of the shard the rank there holds: DTensor's
    own rule for where each placement cuts (torch.chunk's, as FSDP's), at that rank's index along each mesh dimension
    (ParallelMesh flattens axes into a dimension named by them joined with "_", row-major). Ranks of uneven shards are
    read off one build this way instead of being built each."""
    if at is None or not hasattr(p, "placements"):  # a plain tensor is whole on every rank
        return _local(p).numel()
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    mesh = p.device_mesh
    index = []
    for dim, name in enumerate(mesh.mesh_dim_names):
        flat = size = 0
        for axis in name.split("_"):
            flat, size = flat * at[axis][1] + at[axis][0], max(size, 1) * at[axis][1]
        if size != mesh.size(dim):
            raise ValueError(f"mesh dimension {name!r} of size {mesh.size(dim)} is not its axes' product {size}")
        index.append(flat)
    shape, _ = _compute_local_shape_and_global_offset(p.shape, mesh.shape, index, p.placements)
    return math.prod(shape)


# ---------------------------------------------------------------- the tracked step

@dataclass(frozen=True)
class Tracked:
    """One tracked step of a (cut) stage: bytes at the peak, held before the forward (parameters, optimizer
    state), held for backward by one micro-batch's forward (activations), and at the peak of each of the step's
    regions (trackers.REGIONS; the peak is their largest)."""

    peak: int
    static: int
    activations: int
    regions: tuple[int, ...] = ()


@contextlib.contextmanager
def balanced_routing(parts: list[nn.Module], ep: int, dtype: torch.dtype) -> Iterator[None]:
    """Fake tensors have no values to route by: each expert gets the same share of tokens (see the module
    docstring), as real (not fake) counts, so the experts can split by them on the host. Under expert
    parallelism the all-to-all is stood in for by copies of the same size. Experts run grouped in bf16 as on
    GPUs; in fp32 looped, since grouped_mm's meta function (what fake tensors and torch's dispatch-mode
    trackers run) takes bf16 only (torch 2.13)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def balanced(n_tokens: int, n_experts: int) -> torch.Tensor:
        with unset_fake_temporarily():
            counts = torch.full((n_experts,), n_tokens // n_experts, dtype=torch.long)
            counts[: n_tokens % n_experts] += 1
        return counts

    def balanced_counts(experts: nn.Module, args: tuple) -> tuple:  # Experts(x_sorted, counts, grouped)
        x_sorted, counts, *rest = args
        return (x_sorted, balanced(x_sorted.shape[0], counts.numel()), *rest)

    def dispatch(run: Callable, x_sorted: torch.Tensor, counts: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        received = x_sorted.clone()  # the all-to-all's receive buffer (as many tokens arrive as leave)
        return run(received, balanced(x_sorted.shape[0], counts.numel() // ep)).clone()  # and the way back

    moes = [moe for part in parts for moe in part.moe_layers()]
    saved = [(moe, moe.experts.impl) for moe in moes]
    hooks = [moe.experts.register_forward_pre_hook(balanced_counts) for moe in moes]
    for moe in moes:
        moe.experts.force_impl("grouped" if dtype == torch.bfloat16 else "looped")
    try:
        with contextlib.ExitStack() as routed:
            for moe in moes:
                if moe.dispatch is not None:  # expert parallelism's all-to-all
                    routed.enter_context(moe.dispatching(dispatch))
            yield
    finally:
        for hook in hooks:
            hook.remove()
        for moe, impl in saved:
            moe.experts.force_impl(impl)


def tracked_forwards(spec: RunSpec) -> int:
    """Forward/backward passes track_step runs per step: one, or two for any accumulation (the second sees the
    first's gradients, as every later one does). A step that accumulates peaks higher than one that does not, so a
    tracked step stands only for micro-batch sizes with the same count (planner.make_plan's trials)."""
    return min(2, spec.grad_accum * spec.pp_microbatches)


def track_step(spec: RunSpec, mesh: Optional[ParallelMesh], part: nn.Module, kind: str, batch: int,
               grad_ratio: Optional[dict[str, float]] = None) -> Tracked:
    """Peak memory of one training step of `part` (a whole model, or a pipeline stage of `kind` first |
    middle | last) on `batch` sequences per forward: min(2, forwards per step) forward/backward passes (the
    second sees the first's gradients, as accumulation does), then the optimizer step. The optimizer state
    exists before it, as after the first step of a run. `grad_ratio` (given): filled as state_bytes takes it."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    cfg, args = spec.cfg, spec.args
    T = cfg.seq_len
    forwards = tracked_forwards(spec)
    tp_mesh = mesh.submesh("tensor") if mesh is not None else None
    with FakeTensorMode(allow_non_fake_inputs=True), \
            balanced_routing([part], spec.degree("expert"), spec.compute_dtype), \
            blocks_sized_for(spec.device.type), untracked_sharding_propagation():
        part.to_empty(device="cpu")
        part.tie_weights()
        optimizer = build_optimizer(part, cfg.optim, spec.device.type)
        fb = ForwardBackward(part, mesh, torch.device("cpu"), autocast_dtype=spec.autocast_dtype,
                             loss_parallel=spec.parallel.loss_parallel, cp_impl="allgather",
                             output_chunks=spec.output_chunks, fused_output=spec.fused_output)
        tokens = torch.zeros(batch, T, dtype=torch.long)

        def hidden() -> torch.Tensor:  # a stage's input from the previous one (requires grad, like a received one)
            dtype = spec.compute_dtype
            if tp_mesh is None:
                return torch.zeros(batch, T, args.dim, dtype=dtype, requires_grad=True)
            local = torch.zeros(batch, T // spec.degree("tensor"), args.dim, dtype=dtype, requires_grad=True)
            return DTensor.from_local(local, tp_mesh, [Shard(1)], run_check=False)

        def forward_backward() -> None:
            if kind == "whole":
                fb._loss_sum(tokens, tokens, 1.0, backward=True)  # the trainer's own micro-batch step
                return
            with fb.autocast():
                out = part(tokens if kind == "first" else hidden())
            if kind == "last":
                with fb._loss_context():
                    token_loss_sum(out, tokens).backward()
            else:  # the gradient the next stage sends back
                out.backward(torch.ones_like(out))

        def step() -> None:
            for i in range(forwards):
                if pipelined_fsdp:
                    # torch.distributed.pipelining runs every backward but the schedule's last without gradient
                    # reduction or resharding (PipelineStage.backward_maybe_with_nosync): whole gradients and
                    # gathered parameters stay until the step's end
                    last = i == forwards - 1
                    part.set_is_last_backward(last)
                    part.set_reshard_after_backward(last)
                    part.set_requires_gradient_sync(last)
                forward_backward()
            if grad_ratio is not None:  # what each gradient holds, against its parameter's shard
                for name, p in named_params([part]):
                    if p.grad is not None:
                        key = param_key(name, layer_period(spec))
                        grad_ratio[key] = _local(p.grad).numel() / max(_local(p).numel(), 1)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        pipelined_fsdp = kind != "whole" and isinstance(part, FSDPModule)
        # As after a first step: FSDP initialised (its lazy init, which the first forward runs, moves the shards into
        # new storage; FSDPMemTracker must start after it), and the optimizer state (AdamW's update, on zero
        # gradients). The lazy init alone: a forward/backward would cost as many fake-tensor ops as a tracked one.
        if isinstance(part, FSDPModule):
            part._get_fsdp_state()._lazy_init()
        for p in part.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if isinstance(part, FSDPModule):
            tracker: MemTracker = fsdp_step_tracker(part, optimizer)
        else:
            tracker = step_memory_tracker()
            tracker.track_external(part, optimizer)
        tracker.watch(int(index) for index in part.layers.keys())
        marks: dict[str, int] = {}

        def mark(name: str) -> Callable[..., None]:
            def hook(*_: Any) -> None:  # the first forward's (hooks must return None: they could replace args)
                marks.setdefault(name, total_bytes(tracker.get_tracker_snapshot()))
            return hook
        hooks = [part.register_forward_pre_hook(mark("before")), part.register_forward_hook(mark("after"))]
        with tracker:
            step()
        for hook in hooks:
            hook.remove()
    peak = total_bytes(tracker.get_tracker_snapshot("peak"))
    return Tracked(peak, marks["before"], marks["after"] - marks["before"], tuple(tracker.region_peaks.values()))


def layer_period(spec: RunSpec) -> int:
    """Layers after which the stack repeats: whole remat_every periods (selective) and MoE periods (GLaM's moe_every,
    Qwen3-MoE's and Llama 4's sparse_step)."""
    period = spec.cfg.model.remat_every if spec.cfg.model.remat == "selective" else 1
    moe_period = (getattr(spec.args, "moe_every", 1) or 1) if getattr(spec.args, "n_experts", 0) else 1
    sparse_step = (getattr(spec.args, "sparse_step", 1) or 1) if getattr(spec.args, "n_experts", 0) else 1
    return math.lcm(period, moe_period, sparse_step)


def layer_prefix(spec: RunSpec) -> int:
    """Layers at the model's start before the stack repeats: DeepSeek's dense layers ahead of the MoE ones."""
    return getattr(spec.args, "n_dense_layers", 0) if getattr(spec.args, "n_experts", 0) else 0
