"""Step time, collective volumes and MFU of a planned job: an analytic model, since torch's RuntimeEstimator
needs CUDA (it aborts on CPU). What it assumes is stated here, next to the numbers it uses.

Compute: the model's training FLOPs per token (ember/models/*/model.py: 6N + attention, PaLM appendix B)
times the global batch's tokens, plus the forwards that activation checkpointing repeats, over the world's
peak (ember/hardware/peaks.py) times COMPUTE_EFFICIENCY. Communication: the bytes each rank sends per step on
each group (ring algorithms: an all-gather or reduce-scatter of S bytes over n ranks sends S (n-1)/n per
rank, an all-reduce twice that, an all-to-all S (n-1)/n), over the group's link bandwidth times
LINK_EFFICIENCY: within a node when every rank of the group is on one node, else the inter-node one.
FSDP's gathers and reductions and the pipeline's sends overlap with compute (FSDP2 prefetches the next
unit); tensor-, context- and expert-parallel collectives sit between dependent ops and are exposed. The
pipeline bubble stretches the whole step by 1 / (1 - bubble).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ember.errors import ConfigError
from ember.hardware import peaks as hardware
from ember.plan.memory import sharded_dims
from ember.train.run import RunSpec

# Assumptions (not measured here; no accelerator was available to calibrate them):
# - the share of the dense peak a training step's matmuls reach: large bf16 GEMMs run at 70-80% of an H100's
#   peak, and attention, norms and the optimizer bring whole steps lower (Llama 3 paper, table 4: 38-43% MFU
#   for 405B on 16K H100s, with communication and bubbles included);
COMPUTE_EFFICIENCY = 0.6
# - the share of a link's bandwidth a collective reaches (nccl-tests bus bandwidth on DGX H100: ~360-370 of
#   450 GB/s over NVLink; ~45 of 50 GB/s per 400 Gb/s NIC).
LINK_EFFICIENCY = 0.8
# A device's memory minus this share is what a job may use: the CUDA/ROCm context, NCCL buffers and the
# caching allocator's fragmentation take the rest (PyTorch's CUDA caching allocator notes).
MEMORY_RESERVE = 0.1


@dataclass(frozen=True)
class Fabric:
    """A device as `--device` names it: its compute and memory (ember.hardware.peaks), devices per node, the
    bandwidth per device in one direction, in GB/s (10^9 bytes), within a node and across nodes, and its memory's
    bandwidth (HBM, GB/s; what the XLA path's compiled step is priced by, ember.xla.plan)."""

    spec: hardware.DeviceSpec
    per_node: int  # 0: one fast domain whatever the world size (a TPU slice)
    intra_gbs: float
    inter_gbs: float
    source: str
    memory_gbs: Optional[float] = None


# Per-device, one-direction bandwidths. NVIDIA's NVLink figures are bidirectional per GPU (halved here);
# node networks are one NIC per GPU. The last figure is the device's memory bandwidth (GB/s) from the same
# vendor's datasheet: A100 80GB SXM 2,039; H100 SXM 3,350; H200 4,800; B200 and GB200 8,000; MI300X 5,300;
# Cloud TPU pages: v5p 2,765, v5e 819, v6e 1,640.
FABRICS: dict[str, Fabric] = {
    # DGX A100: NVLink 3, 600 GB/s per GPU; 8 ConnectX-6 HDR 200 Gb/s (one per GPU).
    "a100": Fabric(hardware.A100_80GB, 8, 300, 25, "DGX A100 datasheet: NVLink 600 GB/s, 8x 200 Gb/s HDR", 2039),
    # DGX H100: NVLink 4, 900 GB/s per GPU; 8 ConnectX-7 400 Gb/s (one per GPU).
    "h100": Fabric(hardware.H100_SXM, 8, 450, 50, "DGX H100 datasheet: NVLink 900 GB/s, 8x 400 Gb/s ConnectX-7", 3350),
    # HGX H200: the H100's NVLink 4 (900 GB/s) and 400 Gb/s per GPU.
    "h200": Fabric(hardware.H200_SXM, 8, 450, 50, "HGX H200 datasheet: NVLink 900 GB/s, 400 Gb/s per GPU", 4800),
    # DGX B200: NVLink 5, 1.8 TB/s per GPU; 8 ConnectX-7 400 Gb/s.
    "b200": Fabric(hardware.B200, 8, 900, 50, "DGX B200 datasheet: NVLink 1.8 TB/s, 8x 400 Gb/s ConnectX-7", 8000),
    # GB200 NVL72: one NVLink domain of 72 GPUs at 1.8 TB/s each; 800 Gb/s ConnectX-8 per GPU between racks.
    "gb200": Fabric(hardware.GB200, 72, 900, 100, "GB200 NVL72 datasheet: 72-GPU NVLink domain, 1.8 TB/s per GPU",
                    8000),
    # MI300X platform: each GPU has 7 Infinity Fabric links of 128 GB/s (bidirectional) to the other 7;
    # a 400 Gb/s NIC per GPU.
    "mi300x": Fabric(hardware.MI300X, 8, 448, 50, "AMD MI300X platform datasheet: 7x 128 GB/s Infinity Fabric",
                     5300),
    # Cloud TPU: inter-chip interconnect per chip, v5p 4,800 Gb/s, v5e 1,600 Gb/s, v6e 3,584 Gb/s (Cloud TPU
    # system architecture pages); a "node" is a slice. Between slices (DCN) Google publishes no per-chip
    # figure: 25 GB/s is an assumption.
    "tpu-v5p": Fabric(hardware.TPU_V5P, 0, 300, 25, "Cloud TPU v5p: ICI 4,800 Gb/s per chip; DCN assumed", 2765),
    "tpu-v5e": Fabric(hardware.TPU_V5E, 0, 100, 25, "Cloud TPU v5e: ICI 1,600 Gb/s per chip; DCN assumed", 819),
    "tpu-v6e": Fabric(hardware.TPU_V6E, 0, 224, 25, "Cloud TPU v6e: ICI 3,584 Gb/s per chip; DCN assumed", 1640),
}


def fabric(name: str) -> Fabric:
    if name not in FABRICS:
        raise ConfigError(f"unknown --device '{name}' (choose from {', '.join(FABRICS)}, cpu)")
    return FABRICS[name]


def cpu_fabric(world_size: int, dtype: torch.dtype = torch.float32, xla: bool = False) -> Fabric:
    """This machine's CPU (the plan checked against real CPU runs): the measured matmul peak (bf16's too for a
    bf16 plan, as ember.hardware.peaks.peak_flops measures it for a run) shared by the ranks (gloo processes or jax's
    virtual devices all run on these cores), host memory, every rank on one node (gloo over loopback; the
    bandwidth is a placeholder). `xla`: the peak is XLA:CPU's own matmul rate (ember.xla.cpu_rates), the one
    device=xla's step runs at, not torch's."""
    ranks = max(world_size, 1)
    if xla:
        from ember.xla.cpu_rates import xla_cpu_peak_flops

        flops = xla_cpu_peak_flops(torch.float32).rates["fp32"] / ranks
        bf16_flops = xla_cpu_peak_flops(dtype).rates["bf16"] / ranks if dtype == torch.bfloat16 else None
        source = "measured XLA:CPU matmul rate, host memory"
    else:
        flops = hardware.peak_flops(torch.device("cpu"), torch.float32).value_flops / ranks
        bf16 = hardware.peak_flops(torch.device("cpu"), dtype)
        bf16_flops = bf16.value_flops / ranks if bf16.cpu_dtype == torch.bfloat16 else None
        source = "measured matmul rate, host memory"
    memory_gb = hardware_memory_gb()
    spec = hardware.DeviceSpec("CPU", bf16_flops, None, flops, None, memory_gb, source)
    return Fabric(spec, ranks, 5, 5, "gloo over loopback (placeholder bandwidth)")


def hardware_memory_gb() -> float:
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def peak_flops(fab: Fabric, dtype: torch.dtype, fp8: bool = False) -> float:
    """The dense peak the step's matmuls run at: fp8 (precision=fp8, on devices with it), bf16, else fp32."""
    spec = fab.spec
    if fp8 and spec.fp8:
        return spec.fp8
    if dtype in (torch.bfloat16, torch.float16) and spec.bf16:
        return spec.bf16
    # fp32 as the trainer runs it (ember leaves TF32 off, as ember.hardware.peaks's MFU assumes); a TPU, which lists
    # no fp32 rate, runs fp32 matmuls in bf16 passes
    return spec.fp32 or spec.tf32 or spec.bf16


def recompute_factor(remat: str, every: int) -> float:
    """Training FLOPs with activation checkpointing over those without: a block's forward is a third of its
    forward + backward, and `full` runs it twice (every block), `selective` on 1 / every of the blocks.
    `op` recomputes only element-wise ops (no matmul FLOPs). `offload` is priced as `full`: the XLA path's
    offload recomputes every block as full does (its block inputs come back from host memory, a copy the
    overlap hides), and the torch path's save_on_cpu, which recomputes nothing, pays host copies instead."""
    return {"full": 4 / 3, "offload": 4 / 3, "selective": 1 + 1 / (3 * every)}.get(remat, 1.0)


def bubble(schedule: str, pp: int, microbatches: int, stages_per_rank: int) -> float:
    """The idle share of a pipeline flush: (pp - 1) / (m + pp - 1) for GPipe and 1F1B (Narayanan et al.
    2021, sec. 2.2), with v virtual stages per rank (interleaved 1F1B) (pp - 1) / (v m + pp - 1)."""
    if pp == 1:
        return 0.0
    v = stages_per_rank if schedule == "interleaved_1f1b" else 1
    return (pp - 1) / (v * microbatches + pp - 1)


def in_flight(schedule: str, pp: int, pp_rank: int, microbatches: int, stages_per_rank: int) -> int:
    """Stage micro-batches whose activations a pipeline rank holds at once: GPipe all of them; 1F1B the
    warm-up (pp - rank); interleaved 1F1B torch's warm-up, (v - 1) pp + 2 (pp - 1 - rank), plus one."""
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return microbatches * stages_per_rank
    if schedule == "interleaved_1f1b":
        warmup = (stages_per_rank - 1) * pp + 2 * (pp - 1 - pp_rank)
        return min(warmup + 1, microbatches * stages_per_rank)
    return min(pp - pp_rank, microbatches)


def crosses_nodes(grid: torch.Tensor, names: tuple[str, ...], axes: tuple[str, ...], ranks_per_node: int) -> bool:
    """Whether a group over `axes` has ranks on two nodes; `grid` holds the global rank at each coordinate
    of `names` (ember.parallel.mesh.rank_grid), nodes hold consecutive ranks."""
    dims = [names.index(a) for a in axes if a in names]
    if not dims:
        return False
    rest = [i for i in range(len(names)) if i not in dims]
    nodes = grid.permute(rest + dims).reshape(-1, math.prod(grid.shape[i] for i in dims)) // ranks_per_node
    return bool((nodes.max(dim=1).values != nodes.min(dim=1).values).any())


@dataclass
class Traffic:
    """Bytes one rank sends per step on one group, and whether they overlap with compute."""

    axes: tuple[str, ...]
    size: int  # ranks in the group
    bytes: float
    overlapped: bool
    crosses_nodes: bool = False
    seconds: float = 0.0


def fsdp_traffic(params: list[torch.nn.Parameter], gather_bytes: int, reduce_bytes: int, forwards: int,
                 reshard_after_forward: bool) -> list[Traffic]:
    """FSDP's all-gathers (forward, and backward again when parameters were resharded after forward),
    gradient reduce-scatters and, for HSDP, the all-reduce across replicas (of trainable parameters only),
    per forward of the step, from each parameter's own mesh (expert and MoE units shard over other groups
    than the rest)."""
    groups: dict[tuple, Traffic] = {}
    for p in params:
        if not hasattr(p, "placements"):
            continue
        names = p.device_mesh.mesh_dim_names
        shard = [(n, size) for n, size, _ in sharded_dims(p) if n not in ("tensor", "expert")]
        replicate = [p.device_mesh.size(i) for i, n in enumerate(names) if n == "data"]
        local = p.to_local().numel()
        # a frozen parameter (LoRA's base) is gathered, in its own dtype if narrower, and has no gradient to reduce
        gathered, reduced = min(gather_bytes, p.element_size()), reduce_bytes if p.requires_grad else 0
        if shard:  # FSDP shards over one (flattened) mesh dimension
            name, size = shard[0]
            gathers = 2 if reshard_after_forward else 1
            t = groups.setdefault(("fsdp", name), Traffic(tuple(name.split("_")), size, 0.0, True))
            t.bytes += forwards * local * (size - 1) * (gathers * gathered + reduced)
        if replicate and replicate[0] > 1 and p.requires_grad:
            r = replicate[0]
            t = groups.setdefault(("data",), Traffic(("data",), r, 0.0, True))
            t.bytes += forwards * 2 * local * reduce_bytes * (r - 1) / r
    return list(groups.values())


def layer_traffic(spec: RunSpec, n_layers: int, n_moe_layers: int, batch: int, forwards: int) -> list[Traffic]:
    """Tensor, context, expert and pipeline traffic of one rank's `n_layers` layers per step."""
    args, T = spec.args, spec.cfg.seq_len
    tp, cp, ep, pp = (spec.degree(a) for a in ("tensor", "context", "expert", "pipeline"))
    act = spec.compute_dtype.itemsize
    redo = recompute_factor(spec.cfg.model.remat, spec.cfg.model.remat_every) - 1  # share of forwards repeated
    out = []
    seq = T // cp
    if tp > 1:  # sequence parallel: 2 all-gathers + 2 reduce-scatters of (B, T, dim) per layer forward, 4 back
        per_layer = 8 + 4 * 3 * redo
        hidden = batch * seq * args.dim * act * (tp - 1) / tp
        out.append(Traffic(("tensor",), tp, forwards * hidden * (per_layer * n_layers + 4), False))
    if cp > 1:  # all-gathered K and V per layer forward, their gradients reduce-scattered in backward
        kv = 2 * batch * T * (args.kv_heads // tp) * args.head_dim * act * (cp - 1) / cp
        out.append(Traffic(("context",), cp, forwards * kv * n_layers * (2 + 3 * redo), False))
    if ep > 1 and n_moe_layers:  # dispatch and combine all-to-alls, forward and backward
        routed = batch * seq // tp * args.top_k * args.dim * act * (ep - 1) / ep
        out.append(Traffic(("expert",), ep, forwards * routed * n_moe_layers * (4 + 2 * 3 * redo), False))
    if pp > 1:  # a stage's output forward, its gradient back
        out.append(Traffic(("pipeline",), pp, forwards * 2 * batch * seq // tp * args.dim * act, True))
    return out


def time_traffic(traffic: list[Traffic], grid: torch.Tensor, names: tuple[str, ...], ranks_per_node: int,
                 fab: Fabric) -> None:
    for t in traffic:
        t.crosses_nodes = crosses_nodes(grid, names, t.axes, ranks_per_node)
        bandwidth = (fab.inter_gbs if t.crosses_nodes else fab.intra_gbs) * 1e9 * LINK_EFFICIENCY
        t.seconds = t.bytes / bandwidth


@dataclass(frozen=True)
class StepTime:
    flops: float  # model FLOPs per step (no recomputation)
    compute_s: float
    overlapped_s: float
    exposed_s: float
    bubble: float
    step_s: float
    mfu: float
    tokens_per_s: float


def step_time(flops: float, tokens: int, world: int, peak: float, remat: str, remat_every: int,
              traffic: list[Traffic], bubble_share: float) -> StepTime:
    compute = flops * recompute_factor(remat, remat_every) / (world * peak * COMPUTE_EFFICIENCY)
    overlapped = sum(t.seconds for t in traffic if t.overlapped)
    exposed = sum(t.seconds for t in traffic if not t.overlapped)
    step = (max(compute, overlapped) + exposed) / (1 - bubble_share)
    return StepTime(flops, compute, overlapped, exposed, bubble_share, step, flops / (step * world * peak),
                    tokens / step)


def usable_bytes(fab: Fabric) -> float:
    return fab.spec.memory_gb * 2**30 * (1 - MEMORY_RESERVE)


def granularity_warning(params: list[torch.nn.Parameter]) -> Optional[str]:
    """An FSDP group larger than a sharded parameter's rows: some ranks hold none of it (FSDP shards dim 0, or dim
    1 of stacked experts that dim 0 cannot split: ember.parallel.fsdp). Said with the bytes at stake, most often a
    few MiB of routers and norms, which cost nothing else (FSDP pads the empty shards)."""
    worst, held = None, 0
    for p in params:
        if not hasattr(p, "placements"):
            continue
        dims = sharded_dims(p)
        # FSDP's dims that split rows (dim 0): stacked experts it splits on dim 1 when rows are too few
        size = math.prod(s for n, s, d in dims if n not in ("tensor", "expert") and d == 0)
        other = math.prod(s for n, s, d in dims if n in ("tensor", "expert") and d == 0)
        rows = p.shape[0] // max(other, 1)
        if size > rows:
            local = p.to_local()
            held += local.numel() * local.element_size()
            if worst is None or rows < worst[1]:
                worst = (size, rows)
    if worst is None:
        return None
    amount = f"{held / 2**20:.1f} MiB" if held >= 2**20 else f"{held / 2**10:.1f} KiB"
    return (f"uneven shards: {worst[0]} FSDP ranks for parameters of {worst[1]} rows (ranks past row {worst[1]} hold "
            f"none; {amount} per rank at most; figures are rank 0's): fewer fsdp, more data ranks (HSDP) even them")
