"""make_plan: one job's per-rank memory, step time and verdict, computed on one CPU in one process.

Ranks are planned by role: the ranks of one pipeline coordinate hold the same layers, and when every
sharded dimension divides evenly (state_bytes(...).even) the same bytes, so one build per pipeline
coordinate covers the world. Where shards are uneven, every rank's shards are computed from that build in worlds up
to EXACT_WORLD; above that the role's first rank (the largest shards: FSDP cuts dim 0 as torch.chunk does) stands for
all.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ember.config import XLA_DEVICES
from ember.config_schema import JobConfig
from ember.errors import ConfigError
from ember.parallel import pp as pp_lib
from ember.parallel.mesh import AXES, ParallelMesh, rank_grid
from ember.parallel.mesh_shape import MeshShape
from ember.plan import cost
from ember.plan.memory import (
    StateBytes,
    build_parts,
    fake_world,
    layer_period,
    named_params,
    plan_spec,
    state_bytes,
    tracked_forwards,
    with_micro_batch,
)
from ember.plan.stages import StageModel, model_stage, offloaded
from ember.train import run as run_lib
from ember.train.run import RunSpec

EXACT_WORLD = 64  # uneven shards: every rank's planned up to this world size
SEARCH_POLICIES = ("none", "op", "selective", "full")
OFFLOAD_NOTE = ("remat=offload: planned as remat=full with each block's input in host memory instead of on the "
                "device (what XLA's offload and torch's save_on_cpu move there); the host memory is not planned")


def device_policy(remat: str) -> str:
    """The remat policy whose tracked step `remat`'s device memory is derived from: under fake tensors a host copy is
    indistinguishable from a device one, so offload is tracked as full remat and its block inputs taken off
    (stages.offloaded)."""
    return "full" if remat == "offload" else remat  # offload keeps activations on the host: not a device-memory plan


@dataclass
class RankPlan:
    rank: int
    coordinate: dict[str, int]
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    activation_bytes: int
    peak_bytes: int


@dataclass
class Role:
    """The ranks of one pipeline coordinate."""

    pp_rank: int
    stage_ids: list[int]
    kind: str  # whole | first | middle | last: which pieces (embedding, output) its stages hold
    n_layers: int
    ranks: list[int]
    state: Optional[StateBytes] = None
    params: list[torch.nn.Parameter] = field(default_factory=list)
    n_moe_layers: int = 0


@dataclass
class Plan:
    world_size: int
    device: str
    nodes: int
    mesh: str
    fits: bool
    usable_bytes: float
    step: cost.StepTime
    ranks: list[RankPlan]
    roles: list[Role]
    traffic: list[cost.Traffic]
    warnings: list[str]
    micro_batch_size: int
    remat: str
    max_micro_batch: Optional[int]
    options: list[dict[str, Any]]  # --search: feasible (remat, micro-batch) by predicted tokens/s
    searched: bool = False
    seconds: float = 0.0
    micro_batch_limit: Optional[int] = None  # the largest the batch allows (global_batch_size / data-parallel size)
    # device=tpu|xla: the compiled XLA step's memory per device on virtual CPU devices, and its time priced op by
    # op from the program (ember/xla/plan.py)
    xla_memory: Optional[dict[str, int]] = None
    xla_step: Optional[dict[str, Any]] = None
    precision: str = "fp32"  # what the step's matmuls run in: fp32 | bf16 | fp8 (precision=auto resolved)
    peak_flops: float = 0.0  # the device's dense peak at that precision, FLOP/s: what compute time and MFU divide by

    def to_json(self) -> dict[str, Any]:
        """The plan.json contract scripts read: the layout as given, and with --search the feasible candidates
        the table lists, best (most tokens/s) first."""
        document = {"world_size": self.world_size, "device": self.device, "fits": self.fits,
                    "step_time_s": self.step.step_s, "mfu": self.step.mfu, "precision": self.precision,
                    "peak_flops": self.peak_flops,
                    "ranks": [vars(r).copy() for r in self.ranks]}
        if self.searched:
            document["candidates"] = [dict(o) for o in self.options]
        if self.xla_memory is not None:
            document["xla_memory"] = dict(self.xla_memory)
        if self.xla_step is not None:
            document["xla_step"] = dict(self.xla_step)
        return document


def compute_dtype(cfg: JobConfig, device: str) -> torch.dtype:
    """The trainer's choice (ember.train.run.choose_precision): on `--device cpu` this machine's CPU decides (bf16 where
    its bf16 matmuls measured faster at the model's shapes); accelerators in the table all run bf16. The XLA path
    (device=tpu|xla) has its own rule (ember.xla.rules.xla_compute_dtype: auto is bf16 on a TPU, fp32 elsewhere)."""
    if cfg.device in XLA_DEVICES:
        from ember.xla.rules import xla_compute_dtype

        return xla_compute_dtype(cfg.precision, "tpu" if cfg.device == "tpu" or device.startswith("tpu") else "xla")
    if device == "cpu":
        return run_lib.choose_precision(cfg, torch.device("cpu"), run_lib.model_choice(cfg).args).dtype
    return torch.float32 if cfg.precision == "fp32" else torch.bfloat16


def _coordinates(shape: MeshShape) -> list[dict[str, int]]:
    grid = rank_grid(shape, AXES)
    coords: list[dict[str, int]] = [{} for _ in range(shape.world_size)]
    for index in torch.cartesian_prod(*[torch.arange(n) for n in grid.shape]).reshape(-1, len(AXES)).tolist():
        coords[int(grid[tuple(index)])] = {a: c for a, c, n in zip(AXES, index, grid.shape) if n > 1}
    return coords


def _roles(spec: RunSpec, shape: MeshShape) -> list[Role]:
    grid = rank_grid(shape, AXES)  # (pipeline, data, fsdp, context, expert, tensor)
    pp, v = spec.degree("pipeline"), spec.cfg.parallel.pp_stages_per_rank if spec.degree("pipeline") > 1 else 1
    ranges = pp_lib.stage_layer_ranges(spec.args.n_layers, spec.num_stages)
    roles = []
    for p in range(pp):
        ids = pp_lib.stage_ids(p, pp, v) if pp > 1 else [0]
        kind = "whole" if pp == 1 else "first" if 0 in ids else "last" if spec.num_stages - 1 in ids else "middle"
        roles.append(Role(p, ids, kind, sum(len(ranges[i]) for i in ids), sorted(grid[p].flatten().tolist())))
    return roles


def _micro_batch_choices(spec: RunSpec) -> list[int]:
    """Micro-batch sizes the config accepts: divisors of global_batch / dp that the pipeline can split."""
    per_replica = spec.cfg.global_batch_size // spec.shape.dp
    choices = []
    for m in range(1, per_replica + 1):
        if per_replica % m:
            continue
        if spec.degree("pipeline") > 1:
            n = spec.cfg.parallel.pp_microbatches
            M = m if n == -1 else n
            if m % M or (spec.cfg.parallel.pp_schedule == "1f1b" and M < spec.degree("pipeline")):
                continue
            if spec.cfg.parallel.pp_schedule == "interleaved_1f1b" and M % spec.degree("pipeline"):
                continue
        choices.append(m)
    return choices


def _rank_memory(spec: RunSpec, role: Role, model: StageModel) -> tuple[int, int]:
    """(activation bytes, peak bytes) of a rank of `role`: the tracked step at the stage's layers and rows,
    with the pipeline's other in-flight micro-batches' activations on top."""
    par, pp = spec.cfg.parallel, spec.degree("pipeline")
    v = len(role.stage_ids)
    rows = spec.cfg.micro_batch_size // spec.pp_microbatches
    whole = model.at(role.n_layers, rows)
    unit = model.at(role.n_layers / v, rows).activations  # one local stage's activations for one micro-batch
    n = cost.in_flight(par.pp_schedule, pp, role.pp_rank, spec.pp_microbatches, v)
    peak = whole.peak + (n - 1) * unit
    if pp > 1 and spec.num_stages - 1 in role.stage_ids:
        # torch.distributed.pipelining's last stage keeps every micro-batch's output (the logits) and at the
        # end of the schedule's step concatenates them into the merged output it returns (ember's step.py
        # does not pass return_outputs=False): M outputs held through the loop, 2 M at its end, with every
        # gradient there by then.
        M = spec.pp_microbatches
        logits = (rows * (spec.cfg.seq_len // spec.degree("context")) * spec.args.vocab_size
                  * spec.compute_dtype.itemsize)
        # (the in-flight micro-batches' activations above already hold their outputs)
        peak = max(peak + max(M - n, 0) * logits, whole.static + role.state.grad + 2 * M * logits)
    return n * unit, peak


def _step(spec: RunSpec, fab: cost.Fabric, roles: list[Role], grid: torch.Tensor, ranks_per_node: int,
          world: int) -> tuple[cost.StepTime, list[cost.Traffic]]:
    """The slowest role's step time, and its traffic."""
    cfg = spec.cfg
    forwards = spec.grad_accum * spec.pp_microbatches
    rows = cfg.micro_batch_size // spec.pp_microbatches
    gather = spec.compute_dtype.itemsize if spec.fsdp_mixed else 4
    reduce = 4
    tokens = cfg.global_batch_size * cfg.seq_len
    tokens *= 2 if cfg.task == "dpo" else 1  # DPO's rows come in pairs (chosen, rejected), as the trainer counts
    flops = spec.flops_per_token * tokens
    bubble = cost.bubble(cfg.parallel.pp_schedule, spec.degree("pipeline"), spec.pp_microbatches,
                         cfg.parallel.pp_stages_per_rank)
    peak = cost.peak_flops(fab, spec.compute_dtype, fp8=cfg.precision == "fp8")
    best: Optional[tuple[cost.StepTime, list[cost.Traffic]]] = None
    for role in roles:
        traffic = cost.fsdp_traffic(role.params, gather, reduce, forwards, cfg.parallel.reshard_after_forward)
        traffic += cost.layer_traffic(spec, role.n_layers, role.n_moe_layers, rows, forwards)
        cost.time_traffic(traffic, grid, AXES, ranks_per_node, fab)
        step = cost.step_time(flops, tokens, world, peak, cfg.model.remat, cfg.model.remat_every, traffic, bubble)
        if best is None or step.step_s > best[0].step_s:
            best = (step, traffic)
    return best


@dataclass
class StageModels:
    """The plan's tracked stage models (stages.StageModel) by remat policy, stage kind and the forwards its tracked
    step runs (memory.tracked_forwards): a micro-batch size whose step accumulates where the job's does not (or the
    reverse) is tracked on its own, at its own rows. Read off the job's model, a smaller micro-batch was planned
    without the accumulation it brings: MaxText's 64B at 2 sequences per v5e chip was told 1 fits, and its plan at 1
    (accumulating 2) did not fit."""

    roles: list[Role]
    rows_vary: bool  # False with pp_microbatches=-1: a pipeline micro-batch is one sequence, whatever the micro-batch
    models: dict[tuple[str, str, int], StageModel] = field(default_factory=dict)

    def track(self, trial: RunSpec, kind: str, mesh: Optional[ParallelMesh]) -> StageModel:
        """`trial`'s model of a stage `kind`, tracked now if it is not yet (in the fake world of a rank of it)."""
        key = (trial.cfg.model.remat, kind, tracked_forwards(trial))
        if key not in self.models:
            fewest = min(r.n_layers / len(r.stage_ids) for r in self.roles if r.kind == kind)
            rows = trial.cfg.micro_batch_size // trial.pp_microbatches
            tracked = model_stage(with_micro_batch(trial, trial.cfg.micro_batch_size, device_policy(key[0])), mesh,
                                  kind, rows, both_batches=self.rows_vary, fewest_layers=fewest)
            self.models[key] = offloaded(tracked) if key[0] == "offload" else tracked
        return self.models[key]

    def get(self, trial: RunSpec, kind: str) -> StageModel:
        """`trial`'s model of a stage `kind`, tracked in the fake world of its first rank if it is not yet."""
        if (trial.cfg.model.remat, kind, tracked_forwards(trial)) not in self.models:
            rank = next(r for r in self.roles if r.kind == kind).ranks[0]
            with fake_world(rank, trial.world_size):
                self.track(trial, kind, ParallelMesh(trial.shape, "cpu") if trial.world_size > 1 else None)
        return self.track(trial, kind, None)


def make_plan(cfg: JobConfig, world: int, nodes: Optional[int] = None, device: str = "h100",
              search: bool = False) -> Plan:
    """Plan `cfg` (a loaded JobConfig) on `world` devices of type `device` over `nodes` nodes."""
    start = time.perf_counter()
    dtype = compute_dtype(cfg, device)
    fab = cost.cpu_fabric(world, dtype, xla=cfg.device in XLA_DEVICES) if device == "cpu" else cost.fabric(device)
    per_node = fab.per_node or world
    nodes = nodes or max(1, math.ceil(world / per_node))
    if nodes < 1 or world % nodes:
        raise ConfigError(f"--nodes {nodes} does not divide --world {world}: every node runs the same number of ranks")
    ranks_per_node = world // nodes
    spec = plan_spec(cfg, world, "cpu" if device == "cpu" else "cuda", dtype)
    shape = spec.shape
    roles = _roles(spec, shape)
    remats = SEARCH_POLICIES if search else (cfg.model.remat,)
    models = StageModels(roles, rows_vary=spec.degree("pipeline") == 1 or cfg.parallel.pp_microbatches != -1)
    exact: dict[int, StateBytes] = {}
    period = layer_period(spec)
    warnings: list[str] = []
    ranges = pp_lib.stage_layer_ranges(spec.args.n_layers, spec.num_stages)
    if cfg.model.remat == "offload":
        warnings.append(OFFLOAD_NOTE)
    built: dict[tuple, Role] = {}  # roles alike (same pieces, same layer counts) hold the same shards
    for role in roles:
        signature = (role.kind, tuple(len(ranges[i]) for i in role.stage_ids))
        named = None
        if signature in built:
            twin = built[signature]
            role.state, role.params, role.n_moe_layers = twin.state, twin.params, twin.n_moe_layers
        else:
            built[signature] = role
            with fake_world(role.ranks[0], world):
                mesh = ParallelMesh(shape, "cpu") if world > 1 else None
                parts = build_parts(spec, mesh, role.stage_ids)
                named = named_params(parts)
                role.params = [p for _, p in named]
                role.n_moe_layers = sum(len(part.moe_layers()) for part in parts)
                note = cost.granularity_warning(role.params)
                if note and note not in warnings:
                    warnings.append(note)
                grads = models.track(spec, role.kind, mesh).grad_ratio
                for remat in remats:  # --search's
                    models.track(with_micro_batch(spec, cfg.micro_batch_size, remat), role.kind, mesh)
                role.state = state_bytes(named, grads, period)
        if not role.state.even and world <= EXACT_WORLD:
            grads = models.get(spec, role.kind).grad_ratio
            if named is None:  # a twin's stage: its own layers' names, which the gradient ratios are keyed by
                with fake_world(role.ranks[0], world):
                    named = named_params(build_parts(spec, ParallelMesh(shape, "cpu"), role.stage_ids))
            for rank in role.ranks[1:]:  # each rank's shards of the same parameters (memory.local_numel)
                exact[rank] = state_bytes(named, grads, period, on=(shape, rank))
        elif not role.state.even and cost.granularity_warning(role.params) is None:  # (that one says it)
            where = f" on pipeline rank {role.pp_rank}" if len(roles) > 1 else ""
            warnings.append(f"uneven shards{where}: ranks hold slightly different bytes; the figures are the first "
                            f"rank's, the largest")

    coords = _coordinates(shape)
    usable = cost.usable_bytes(fab)

    def memory(trial_spec: RunSpec) -> dict[int, tuple[int, int]]:
        return {role.pp_rank: _rank_memory(trial_spec, role, models.get(trial_spec, role.kind)) for role in roles}

    mem = memory(spec)
    ranks = []
    for role in roles:
        act, peak = mem[role.pp_rank]
        held = role.state.param + role.state.grad + role.state.optim
        for rank in role.ranks:
            sb = exact.get(rank, role.state)
            # uneven shards: the tracked peak is the role's first rank's; others hold more or less state
            delta = sb.param + sb.grad + sb.optim - held
            ranks.append(RankPlan(rank, coords[rank], sb.param, sb.grad, sb.optim, act, peak + delta))
    ranks.sort(key=lambda r: r.rank)
    fits = max(r.peak_bytes for r in ranks) <= usable

    grid = rank_grid(shape, AXES)
    step, traffic = _step(spec, fab, roles, grid, ranks_per_node, world)

    # The largest micro-batch that fits (the first that fits, from the largest down: a trial whose step accumulates
    # where the job's does not is tracked on its own), and with --search every feasible (remat, micro-batch).
    max_mb, options = None, []
    for remat in remats:
        for m in sorted(_micro_batch_choices(spec), reverse=True):
            trial = with_micro_batch(spec, m, remat)
            peak = max(p for _, p in memory(trial).values())
            if peak > usable:
                continue
            if remat == cfg.model.remat:
                max_mb = max(max_mb or 0, m)
            if not search:
                break
            t, _ = _step(trial, fab, roles, grid, ranks_per_node, world)
            options.append({"remat": remat, "micro_batch_size": m, "peak_bytes": peak,
                            "step_time_s": t.step_s, "tokens_per_s": t.tokens_per_s, "mfu": t.mfu})
    options.sort(key=lambda o: -o["tokens_per_s"])

    warnings += _layout_warnings(spec, traffic, step, fab, fits, max(r.peak_bytes for r in ranks), usable, device)
    return Plan(world, device, nodes, shape.describe(), fits, usable, step, ranks, roles, traffic, warnings,
                cfg.micro_batch_size, cfg.model.remat, max_mb, options, search, time.perf_counter() - start,
                max(_micro_batch_choices(spec), default=None), precision=_precision_name(cfg.precision, fab, dtype),
                peak_flops=cost.peak_flops(fab, dtype, fp8=cfg.precision == "fp8"))


def _precision_name(precision: str, fab: cost.Fabric, dtype: torch.dtype) -> str:
    """What the step's matmuls run in, as the trainer would pick it (precision=auto resolved)."""
    if precision == "fp8" and fab.spec.fp8:
        return "fp8"
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
    if name == "fp32" and not fab.spec.fp32:  # priced at what cost.peak_flops falls back to
        return "fp32 (at the tf32 peak)" if fab.spec.tf32 else "fp32 (at the bf16 peak)"
    return name


def _layout_warnings(spec: RunSpec, traffic: list[cost.Traffic], step: cost.StepTime, fab: cost.Fabric, fits: bool,
                     peak: int, usable: float, device: str) -> list[str]:
    notes = []
    if not fits:
        axes = "fsdp, tensor" if spec.cfg.device in XLA_DEVICES else "fsdp, tensor, pipeline"  # no XLA pipeline
        remat = ("" if spec.cfg.model.remat in ("full", "offload") else
                 f" or set model.remat (full or offload; now {spec.cfg.model.remat})")
        notes.append(f"does not fit: the peak of {peak / 2**30:.1f} GiB exceeds the {usable / 2**30:.1f} GiB usable on "
                     f"a {device} ({fab.spec.memory_gb:g} GiB less {cost.MEMORY_RESERVE:.0%} reserve); shard more "
                     f"({axes}), lower micro_batch_size (the global batch stays, accumulated){remat}")
    for t in traffic:
        if t.crosses_nodes and t.axes[0] in ("tensor", "context"):
            notes.append(f"the {t.axes[0]} axis ({t.size} ranks) crosses nodes: its per-layer collectives run at "
                         f"{fab.inter_gbs:g} instead of {fab.intra_gbs:g} GB/s; keep it in ici_mesh within a node")
    if step.bubble > 0.1:
        notes.append(f"pipeline bubble {step.bubble:.0%} ({spec.degree('pipeline')} stages, {spec.pp_microbatches} "
                     f"micro-batches per flush): raise micro_batch_size or parallel.pp_microbatches")
    return notes
