"""The Trainer: build everything in a fixed order, then run the loop. Read it top to bottom.

Build order (ARCHITECTURE.md): model on meta -> parallelize -> to_empty -> init_weights -> optimizer.
Loss and gradient-accumulation math live in `train_step` and nowhere else.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import math
import os
import signal
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from ember import config as config_lib
from ember.config import ConfigError, JobConfig
from ember.data.loader import build_loader
from ember.data.packing import IGNORE_INDEX
from ember.data.tokenizer import build_tokenizer
from ember.hardware import peak_flops
from ember.checkpoint import CheckpointError, CheckpointManager, meta_for, rng_state, set_rng_state
from ember.load import load_weights
from ember.metrics import MetricsLogger, mfu, peak_memory_gb
from ember.models import MODELS, build_model_args
from ember.nn.attention import document_layout
from ember.nn.loss import cross_entropy_sum, output_chunks
from ember.nn.moe import MoE, attach_router_loss
from ember.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_
from ember.parallel import cp as cp_lib
from ember.parallel import pp as pp_lib
from ember.parallel.mesh import ParallelMesh



class TrainingStopped(RuntimeError):
    """The run stopped itself (e.g. too many non-finite steps); the message says why and what to do."""


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is visible; use device=cpu or device=auto")
    return torch.device(name)


def pick_compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """bf16 autocast where the device runs it fast (CUDA with bf16 support), fp32 on CPU by default."""
    if precision == "fp32":
        return torch.float32
    if precision == "bf16":
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ConfigError("precision=bf16 but this GPU has no bf16 support; use precision=fp32")
        return torch.bfloat16
    bf16_ok = device.type == "cuda" and torch.cuda.is_bf16_supported()
    return torch.bfloat16 if bf16_ok else torch.float32


def init_distributed(device: torch.device, timeout_s: int) -> None:
    """Join the torchrun job: gloo on CPU, NCCL on CUDA (RCCL on ROCm). Idempotent. The timeout bounds
    how long a rank waits on a peer that died, so a failure ends the job instead of hanging it."""
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


def _on_moe_forward(trainer: weakref.ref, *args: Any) -> Any:
    alive = trainer()
    return None if alive is None else alive._on_moe_forward(*args)


def _is_dtensor(x: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


class Trainer:
    """Owns the model, optimizer, data and metrics of one run, on one process or as one rank of many."""

    def __init__(self, cfg: JobConfig, console: Optional[Console] = None):
        self.cfg = cfg
        # soft_wrap: a metrics line stays one line in logs and pipes, whatever the terminal width.
        self.console = console or Console(soft_wrap=True)
        self.rank, self.world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        self.is_main = self.rank == 0
        self.device = pick_device(cfg.device)
        if self.device.type == "cuda" and self.world_size > 1:
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        self.compute_dtype = pick_compute_dtype(cfg.precision, self.device)
        self.output_dir = Path(cfg.output_dir)

        # The mesh: ici x dcn degrees checked against the world, then one DeviceMesh for the job.
        shape = config_lib.mesh_shape(cfg, self.world_size)
        self.mesh: Optional[ParallelMesh] = None
        if self.world_size > 1:
            init_distributed(self.device, cfg.parallel.timeout_s)
            self.mesh = ParallelMesh(shape, self.device.type)
        self.shape = shape
        self.tp, self.pp, self.cp = shape.degree("tensor"), shape.degree("pipeline"), shape.degree("context")
        # The loader reads by data-parallel coordinate: ranks of one replica (tensor, pipeline, context)
        # read the same batch.
        self.dp_rank, self.dp_world = (self.mesh.dp_rank if self.mesh else 0), shape.dp
        self.grad_accum = config_lib.grad_accum_steps(cfg, self.dp_world)
        torch.manual_seed(cfg.seed)

        # Tokenizer first: the model's vocabulary must cover it, and that is a config error, not a crash.
        spec = MODELS[cfg.model.family]
        self.model_args = build_model_args(cfg.model.family, cfg.model.flavor, config_lib.model_overrides(cfg.model))
        self.tokenizer = None
        if cfg.data.dataset != "synthetic":
            self.tokenizer = build_tokenizer(cfg.data, self.model_args.vocab_size)

        # Model: meta -> (pipeline split) -> parallelize -> to_empty -> init_weights, so 405B never
        # materialises on one host. Each rank builds only its pipeline stages.
        self.val_note: Optional[str] = None
        self.cp_impl = cfg.parallel.cp_impl
        if self.cp_impl == "auto":
            self.cp_impl = "ring" if self.device.type == "cuda" else "allgather"
        if self.cp > 1 and self.cp_impl == "ring" and self.device.type != "cuda":
            raise ConfigError("parallel.cp_impl=ring needs CUDA (SDPA's CPU kernel has no ring form); use allgather")
        if cfg.parallel.cpu_offload and (self.device.type != "cuda" or shape.grad_sync == 1):
            raise ConfigError("parallel.cpu_offload moves FSDP-sharded parameters and optimizer state from the GPU "
                              "to host memory; it needs device=cuda and a data/fsdp axis > 1 (on CPU they are already there)")
        # FSDP's mixed precision (bf16 compute, fp32 gradient reduction) replaces autocast where FSDP runs.
        self.fsdp_mixed = (self.mesh is not None and self.shape.grad_sync > 1 and cfg.parallel.mixed_precision
                           and self.compute_dtype != torch.float32)
        self.loss_parallel = self.tp > 1 and cfg.parallel.loss_parallel and self.pp == 1
        with torch.device("meta"):
            whole = spec.model_cls(self.model_args)
        self.num_params = sum(p.numel() for p in whole.parameters())
        self.n_moe_layers = sum(isinstance(m, MoE) for m in whole.modules())  # the whole model's, not a stage's
        if self.pp > 1:
            num_stages = self.pp * cfg.parallel.pp_stages_per_rank
            ids = pp_lib.stage_ids(self.mesh.coordinate("pipeline"), self.pp, cfg.parallel.pp_stages_per_rank)
            parts = [(sid, pp_lib.split_model(whole, sid, num_stages)) for sid in ids]
        else:
            num_stages, parts = 1, [(0, whole)]
        for _, part in parts:
            spec.parallelize(
                part, self.mesh, compile=cfg.compile, remat=cfg.model.remat, remat_every=cfg.model.remat_every,
                param_dtype=self.compute_dtype if self.fsdp_mixed else None,
                reduce_dtype=torch.float32 if self.fsdp_mixed else None,
                reshard_after_forward=cfg.parallel.reshard_after_forward, cpu_offload=cfg.parallel.cpu_offload,
                loss_parallel=self.loss_parallel, cp_impl=self.cp_impl,
                flex_attention=cfg.data.document_mask and self.device.type == "cuda",
            )
            # With CPU offload FSDP keeps the sharded parameters in host memory and moves them itself.
            part.to_empty(device="cpu" if cfg.parallel.cpu_offload else self.device)
            part.tie_weights()  # to_empty gives each module its own Parameter
        self.model_parts: list[nn.Module] = [part for _, part in parts]
        # MoE layers of this rank's stages, by global layer number (GLaM alternates dense and MoE blocks)
        self.moe_layers: list[tuple[int, MoE]] = [
            (int(name), module) for part in self.model_parts for name, block in part.layers.items()
            for module in block.modules() if isinstance(module, MoE)]
        self._router_stats: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> latest (aux, z)
        # (layers, experts) tokens over the logging window, indexed by global layer number (zeros where
        # another pipeline stage holds the layer, or a dense GLaM layer); fp64 counts stay exact when summed.
        n_experts = getattr(self.model_args, "n_experts", None) or 0
        self._expert_load = torch.zeros(self.model_args.n_layers, n_experts, device=self.device, dtype=torch.float64)
        self._step_load: dict[int, list[torch.Tensor]] = {}  # layer -> tokens per expert of each training forward
        # Held weakly: the model can then be deep-copied (an EMA, an export) and does not keep the trainer alive.
        for i, moe in self.moe_layers:
            moe.register_forward_hook(functools.partial(_on_moe_forward, weakref.ref(self), i), prepend=True)
        if self.tp == 1 and self.pp == 1:  # plain-tensor logits of the whole sequence: compute them in chunks
            whole.output_chunks = output_chunks(cfg.micro_batch_size, cfg.seq_len // self.cp,
                                                self.model_args.vocab_size, self.device.type)
        self._init_weights(spec)
        if cfg.model.init_from:
            load_weights(self.model_parts, cfg.model.init_from)
        # One module for the optimizer, clipping and `model.train()`: the model, or this rank's stages.
        self.model = self.model_parts[0] if len(self.model_parts) == 1 else nn.ModuleList(self.model_parts)
        self.spec = spec
        self.flops_per_token = spec.flops_per_token(self.model_args, cfg.seq_len)
        self.schedule = None
        self.pp_microbatches = 1  # forwards of each layer per micro-batch
        if self.pp > 1:
            pp_mb = cfg.parallel.pp_microbatches
            self.pp_microbatches = cfg.micro_batch_size if pp_mb == -1 else pp_mb
            self._pp_token_count = 1
            self.schedule = pp_lib.build_schedule(
                parts, num_stages, self.device, self.mesh.submesh("pipeline"), cfg.parallel.pp_schedule,
                self.pp_microbatches, self._pp_loss,
            )
            self.has_first_stage = 0 in [sid for sid, _ in parts]
            self.has_last_stage = num_stages - 1 in [sid for sid, _ in parts]

        self.optimizer = build_optimizer(self.model, cfg.optim, self.device.type)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.schedule, cfg.max_steps)

        loader_kwargs = dict(
            seq_len=cfg.seq_len,
            micro_batch_size=cfg.micro_batch_size,
            dp_rank=self.dp_rank,
            dp_world=self.dp_world,
            seed=cfg.seed,
            vocab_size=self.model_args.vocab_size,
        )
        self.train_loader = build_loader(cfg.data, self.tokenizer, split="train", **loader_kwargs)
        self.val_loader = None
        try:
            self.val_loader = build_loader(cfg.data, self.tokenizer, split="val", **loader_kwargs)
        except ValueError as err:  # a held-out split too small for one batch: train without validation
            self.val_note = f"no validation: {err}"

        peak = peak_flops(self.device, self.compute_dtype, cfg.metrics.peak_tflops)
        self.peak_flops, self.peak_source = peak.value_flops, peak.source
        self.step = 0
        self.last_step_skipped = False
        self.skipped_in_a_row, self.skipped_total = 0, 0
        self._loss_mean: Optional[float] = None  # running mean for the loss-spike warning
        self._stop_signal: Optional[int] = None

        # Checkpoints: resume restores weights, optimizer, schedule, data position and RNG exactly.
        self.checkpointer = CheckpointManager(
            cfg.checkpoint, self.output_dir, self.model_parts, self.model, self.optimizer,
            meta_for(cfg.model.family, cfg.model.flavor, self.model_args), say=self._say)
        try:
            state = self.checkpointer.resume(cfg.resume)
        except CheckpointError as err:
            raise ConfigError(str(err)) from None
        if state is not None:
            self.step = int(state["step"])
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
            self.train_loader.load_state_dict(state["data"])
            set_rng_state(state["rng"])
            self.skipped_in_a_row, self.skipped_total = state["skipped_in_a_row"], state["skipped_total"]
            self._loss_mean = state["loss_mean"]

    def _say(self, message: str) -> None:
        if self.is_main:
            self.console.print(message, markup=False, highlight=False)

    def train_state(self) -> dict:
        """This rank's part of a checkpoint beside the DCP weights and optimizer state."""
        return {"step": self.step, "lr_scheduler": self.lr_scheduler.state_dict(),
                "data": self.train_loader.state_dict(), "rng": rng_state(),
                "skipped_in_a_row": self.skipped_in_a_row, "skipped_total": self.skipped_total,
                "loss_mean": self._loss_mean}

    @torch.no_grad()
    def _init_weights(self, spec: Any) -> None:
        """Random init of this rank's (sharded) parameters, seeded by `seed`."""
        torch.manual_seed(self.cfg.seed)
        if self.mesh is None or self.device.type != "cpu":
            # On CUDA, DTensor's offset-based RNG gives each shard its own part of one random stream.
            for part in self.model_parts:
                part.init_weights(buffer_device=self.device)
            return
        # On a CPU mesh, DTensor random ops draw the same numbers on every rank (CPU generators have no
        # offsets), so FSDP/TP shards would be copies of one another. Initialise one full copy instead
        # and keep this rank's shard: the values a single process would have, whatever the layout.
        from torch.distributed.tensor import DTensor, distribute_tensor

        with torch.device("meta"):
            full = spec.model_cls(self.model_args)
        full.to_empty(device="cpu")
        full.init_weights()
        full_state = full.state_dict()
        for part in self.model_parts:
            part.init_rope(self.device)
            for name, tensor in part.state_dict().items():
                source = full_state[name]
                if isinstance(tensor, DTensor):
                    shard = distribute_tensor(source, tensor.device_mesh, tensor.placements, src_data_rank=None)
                    tensor.to_local().copy_(shard.to_local())
                else:
                    tensor.copy_(source)

    # ---------------------------------------------------------------- one optimizer step
    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.compute_dtype == torch.float32 or self.fsdp_mixed:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def _loss_context(self) -> contextlib.AbstractContextManager:
        # Cross-entropy on vocabulary-sharded logits, forward and backward, when tensor parallel.
        if self.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    @staticmethod
    def _token_loss_sum(logits: Any, labels: torch.Tensor) -> torch.Tensor:
        """Summed token cross-entropy in fp32; logits (B, T, V), or the model's list of chunks of them."""
        if _is_dtensor(logits):  # vocabulary-sharded logits (loss parallel): DTensor's cross-entropy
            return F.cross_entropy(
                logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=IGNORE_INDEX, reduction="sum"
            )
        return cross_entropy_sum(logits, labels)

    def _pp_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self._token_loss_sum(logits, labels) / self._pp_token_count

    def _all_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a tensor over every rank, in place (a no-op on one process)."""
        if self.mesh is not None:
            dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return value

    def _global_token_count(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Target tokens in the global batch: each replica's count, summed over the data-parallel ranks
        (the tensor, pipeline and context ranks of a replica hold the same labels, so they divide out)."""
        local = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in micro_batches)
        total = self._all_sum(torch.tensor(float(local), device=self.device))
        return round(float(total) / (self.tp * self.pp * self.cp))

    def _forward_loss_sum(self, inputs: torch.Tensor, labels: torch.Tensor, scale: float,
                          backward: bool) -> torch.Tensor:
        """The summed token loss of this rank's share of one micro-batch, times `scale`; with
        backward, its gradients too. Context parallelism cuts the sequence here."""
        inputs = inputs.to(self.device, non_blocking=True)
        labels = labels.to(self.device, non_blocking=True)
        positions = document_ids = None
        if self.cfg.data.document_mask:
            document_ids, positions = document_layout(inputs, self.tokenizer.eos_id)
        ring = contextlib.nullcontext()
        if self.cp > 1:
            cp_rank = self.mesh.coordinate("context")
            if self.cp_impl == "allgather":
                positions = cp_lib.headtail_positions(inputs.shape[1], self.cp, cp_rank, self.device)
                inputs = cp_lib.shard_sequence(inputs, self.cp, cp_rank)
                labels = cp_lib.shard_sequence(labels, self.cp, cp_rank)
            else:  # torch's ring attention shards these three in place for the duration
                positions = torch.arange(inputs.shape[1], device=self.device)
                ring = cp_lib.ring_context(self.mesh.submesh("context"), [inputs, labels, positions], [1, 1, 0],
                                           {inputs, labels})
        with ring, self._loss_context():
            with self._autocast():
                logits = self.model(inputs, positions, document_ids)  # (B, T, V)
            loss = self._token_loss_sum(logits, labels) * scale
            if backward:
                loss.backward()  # the MoE router losses join in their layers (_on_moe_forward)
        return loss.full_tensor().detach() if _is_dtensor(loss) else loss.detach()

    def _on_moe_forward(self, layer: int, moe: MoE, inputs: tuple, output: torch.Tensor) -> Optional[torch.Tensor]:
        """After each training forward of a MoE layer: add its tokens per expert to the logging window's
        load, and attach its router losses to its output (ember.nn.moe.attach_router_loss), weighted so
        that the objective adds coef x their mean over the model's MoE layers and over the step's routed
        tokens. Weighing each forward by the tokens it routed makes that hold in every layout: data,
        expert and pipeline micro-batches, and the sequence shards of tensor and context ranks."""
        if not moe.training or torch._C._current_graph_task_id() != -1:
            return None  # evaluation, or activation checkpointing recomputing the forward inside backward
        self._step_load.setdefault(layer, []).append(moe.tokens_per_expert)
        self._router_stats[layer] = (moe.aux_loss.detach(), moe.z_loss.detach())
        aux_coef, z_coef = self.cfg.model.aux_loss_coef, self.cfg.model.z_loss_coef
        if not (aux_coef or z_coef):
            return None
        routed = inputs[0].to_local() if _is_dtensor(inputs[0]) else inputs[0]
        weight = routed.shape[:-1].numel() / (self.cfg.global_batch_size * self.cfg.seq_len * self.n_moe_layers)
        return attach_router_loss(output, aux_coef * moe.aux_loss + z_coef * moe.z_loss, weight)

    def _add_step_load(self, forwards_per_layer: int) -> None:
        """Add this step's expert load to the logging window's, from the last `forwards_per_layer` training
        forwards of each layer (a step's micro-batches, times the pipeline's): torch 2.13's pipeline stages
        run one more forward on their first step, on placeholder inputs to infer shapes, which is no load."""
        for layer, counts in self._step_load.items():
            self._expert_load[layer] += torch.stack(counts[-forwards_per_layer:]).sum(0)  # read only when logged
        self._step_load.clear()

    def _moe_record(self) -> dict[str, Any]:
        """`aux_loss` and `z_loss`: the latest micro-batch's router losses, averaged over every rank's MoE
        layers. Per MoE layer i, over the logging window and every rank: `moe/layer{i}/tokens_per_expert`
        (a list) and `moe/layer{i}/imbalance` (max over mean tokens per expert, 1.0 when balanced); and
        `expert_imbalance`, their mean over layers. Every rank must call it (one all-reduce)."""
        if not self._expert_load.numel():  # the model's family, not this rank's stage: a dense stage still joins
            return {}
        router = torch.zeros(3, device=self.device, dtype=torch.float64)  # sum of aux, sum of z, layers
        for aux, z in self._router_stats.values():
            router += torch.stack([aux.double(), z.double(), torch.ones((), device=self.device, dtype=torch.float64)])
        # One sum over all ranks: data-parallel ranks' loads add up, pipeline stages' layers are gathered.
        totals = self._all_sum(torch.cat([self._expert_load.flatten(), router]))
        self._expert_load.zero_()
        load = totals[:-3].view_as(self._expert_load)
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

    def _pipeline_loss_sum(self, inputs: torch.Tensor, labels: torch.Tensor, scale: float,
                           backward: bool) -> torch.Tensor:
        """The same through the pipeline schedule: the last stage computes the loss per pipeline
        micro-batch; other stages report 0."""
        self._pp_token_count = 1.0 / scale
        args = (inputs.to(self.device),) if self.has_first_stage else ()
        losses: list[torch.Tensor] = []
        run = self.schedule.step if backward else self.schedule.eval
        run(*args, target=labels.to(self.device), losses=losses)
        if self.has_last_stage and losses:
            return torch.stack([l.detach() for l in losses]).sum()
        return torch.zeros((), device=self.device)

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
        """Forward/backward over this rank's micro-batches of one global batch, clip, step.

        The loss is the mean over every target token of the global batch: each micro-batch contributes
        its *sum* of token losses divided by the global token count, so unequal micro-batches (masked
        labels) weigh correctly, gradient accumulation needs no extra scaling, and data-parallel
        gradient reductions sum (parallel/fsdp.py) instead of averaging.
        """
        self.model.train()
        n_tokens = self._global_token_count(micro_batches)
        loss_total = torch.zeros((), device=self.device)
        step_fn = self._pipeline_loss_sum if self.schedule is not None else self._forward_loss_sum
        for inputs, labels in micro_batches:
            loss_total += step_fn(inputs, labels, 1.0 / max(n_tokens, 1), backward=True)
        self._add_step_load(len(micro_batches) * self.pp_microbatches)
        grad_norm = clip_grad_norm_(self.model.parameters(), self.cfg.optim.max_grad_norm,
                                    pp_mesh=self.mesh.submesh("pipeline") if self.mesh else None)
        # Every rank's share summed; tensor-parallel ranks each hold the whole replica's loss.
        loss = float(self._all_sum(loss_total) / self.tp)
        grad_norm = float(grad_norm)
        # Both are global, so every rank takes the same decision: a non-finite step changes no weight.
        self.last_step_skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
        if not self.last_step_skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        return loss, grad_norm

    @torch.no_grad()
    def evaluate(self) -> Optional[float]:
        if self.val_loader is None or (self.schedule is not None and not hasattr(self.schedule, "eval")):
            return None
        self.model.eval()
        self.val_loader.reset()  # the same validation batches every time, so evaluations compare
        val_iter = iter(self.val_loader)
        # eval_batches global batches, whatever the layout: each rank reads its share of the same samples.
        batches = [next(val_iter) for _ in range(self.cfg.eval_batches * self.grad_accum)]
        n_tokens = self._global_token_count(batches)
        loss_fn = self._pipeline_loss_sum if self.schedule is not None else self._forward_loss_sum
        loss_sum = torch.zeros((), device=self.device)
        for inputs, labels in batches:
            loss_sum += loss_fn(inputs, labels, 1.0 / max(n_tokens, 1), backward=False)
        self.model.train()
        return float(self._all_sum(loss_sum) / self.tp)

    # ---------------------------------------------------------------- the loop
    def _global_batches(self) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
        train_iter = iter(self.train_loader)
        while True:
            yield [next(train_iter) for _ in range(self.grad_accum)]

    def train(self) -> dict:
        cfg = self.cfg
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if self.is_main:
            config_lib.save(cfg, self.output_dir / "config.yaml")
        logger = MetricsLogger(self.output_dir, cfg.metrics, enabled=self.is_main, console=self.console)
        self._print_header()
        if self.peak_flops is None and self.is_main:
            self.console.print(f"[yellow]MFU not reported: {self.peak_source}[/yellow]")

        tokens_per_step = cfg.global_batch_size * cfg.seq_len
        history: list[dict] = []
        window_time, window_steps, window_loss, window_data = 0.0, 0, 0.0, 0.0
        first_loss: Optional[float] = None
        batches = self._global_batches()
        progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
            disable=not (self.is_main and cfg.metrics.console),
            transient=False,
        )
        stopped = False
        previous_handlers = self._install_signal_handlers()
        if self.step >= cfg.max_steps and self.step > 0:
            self._say(f"already at step {self.step} of max_steps={cfg.max_steps}: nothing to train "
                      "(raise max_steps to continue, or resume=none to start over)")
        with progress:
            task = progress.add_task("train", total=cfg.max_steps, loss="-", completed=self.step)
            while self.step < cfg.max_steps:
                t0 = time.perf_counter()
                micro_batches = next(batches)
                data_wait = time.perf_counter() - t0  # time the step waited for the loader
                lr = self.optimizer.param_groups[0]["lr"]
                loss, grad_norm = self.train_step(micro_batches)
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                step_time = time.perf_counter() - t0
                self.step += 1
                if self.last_step_skipped:
                    self._skipped_step(loss, grad_norm)
                    progress.update(task, advance=1)
                    continue
                self.skipped_in_a_row = 0
                self._check_spike(loss, logger)
                first_loss = loss if first_loss is None else first_loss
                window_time, window_steps, window_loss = window_time + step_time, window_steps + 1, window_loss + loss
                window_data += data_wait
                progress.update(task, advance=1, loss=f"{loss:.3f}")
                if self.step % cfg.logging_steps == 0 or self.step == cfg.max_steps:
                    tokens_per_s = tokens_per_step * window_steps / window_time
                    per_device = tokens_per_s / self.world_size
                    achieved = per_device * self.flops_per_token
                    record = {
                        "step": self.step,
                        "loss": loss,
                        "loss_avg": window_loss / window_steps,
                        "lr": lr,
                        "grad_norm": grad_norm,
                        "tokens_per_s": tokens_per_s,
                        "tokens_per_s_per_device": per_device,
                        "step_time_s": window_time / window_steps,
                        "tflops_per_device": achieved / 1e12,
                        "mfu": mfu(per_device, self.flops_per_token, self.peak_flops),
                        "memory_gb": peak_memory_gb(self.device),
                        "tokens_seen": self.step * tokens_per_step,
                        "data_wait_frac": window_data / window_time,  # share of step time spent waiting for data
                    }
                    # MoE: router losses, and the load of every expert of every layer over the window
                    record.update(self._moe_record())
                    for source, count in (self.train_loader.mixture_counts() or {}).items():
                        record[f"mix/{source}"] = count  # samples drawn from each mixture source so far
                    logger.log(self.step, record)
                    history.append(record)
                    window_time, window_steps, window_loss, window_data = 0.0, 0, 0.0, 0.0
                # Validation on its own cadence, outside the timed window of the step it follows.
                if cfg.eval_interval and self.step % cfg.eval_interval == 0 and self.step < cfg.max_steps:
                    logger.log(self.step, {"step": self.step, "val_loss": self.evaluate()})
                self.checkpointer.poll()
                if self._agree_to_stop():
                    self._say(f"signal {self._stop_signal}: saving a checkpoint at step {self.step} and exiting")
                    self.checkpointer.save(self.step, self.train_state(), blocking=True)
                    stopped = True
                    break
                if self.checkpointer.due(self.step) and self.step < cfg.max_steps:
                    self.checkpointer.save(self.step, self.train_state())

        self._restore_signal_handlers(previous_handlers)
        val_loss = None if stopped else self.evaluate()
        for loader in (self.train_loader, self.val_loader):
            if loader is not None:
                loader.close()  # stop the prefetch threads before the process moves on
        step_dir = self.output_dir / "checkpoints" / f"step-{self.step}"
        if not stopped and not (step_dir / "model.json").is_file():
            self.checkpointer.save(self.step, self.train_state(), blocking=True)
        self.checkpointer.wait()
        summary = {
            "first_loss": first_loss,
            "final_loss": history[-1]["loss"] if history else None,
            "final_loss_avg": history[-1]["loss_avg"] if history else None,
            "val_loss": val_loss,
            "steps": self.step,
            "checkpoint": str(step_dir),
            "stopped_by_signal": stopped,
            "skipped_steps": self.skipped_total,
        }
        if val_loss is not None:
            logger.log(self.step, {"step": self.step, "val_loss": val_loss})
        logger.close()
        if self.is_main and cfg.metrics.console and first_loss is not None:
            val = f", validation loss {val_loss:.3f}" if val_loss is not None else ""
            self.console.print(
                f"done: {self.step} steps, loss {first_loss:.3f} -> {summary['final_loss_avg']:.3f} "
                f"(mean of the last {cfg.logging_steps} steps){val}; model saved to {step_dir}"
            )
        return summary

    # ---------------------------------------------------------------- guards and signals
    def _skipped_step(self, loss: float, grad_norm: float) -> None:
        self.skipped_in_a_row += 1
        self.skipped_total += 1
        self._say(f"warning: step {self.step} skipped: loss {loss}, grad norm {grad_norm} "
                  f"({self.skipped_in_a_row} in a row, {self.skipped_total} in all)")
        if self.skipped_in_a_row > self.cfg.max_skipped_steps:
            self.checkpointer.save(self.step, self.train_state(), blocking=True)
            raise TrainingStopped(
                f"{self.skipped_in_a_row} steps in a row had a non-finite loss or grad norm (max_skipped_steps="
                f"{self.cfg.max_skipped_steps}); the last good weights are in checkpoints/step-{self.step}. "
                "Lower optim.lr, raise schedule.warmup_steps or check the data, then resume"
            )

    def _check_spike(self, loss: float, logger: MetricsLogger) -> None:
        factor = self.cfg.loss_spike_factor
        mean = self._loss_mean
        if factor > 0 and mean is not None and self.step > 10 and loss > factor * mean:
            position = self.train_loader.state_dict()
            position = {k: v for k, v in position.items() if k in ("epoch", "cursor", "draws")}
            self._say(f"warning: loss spike at step {self.step}: {loss:.4f} is over {factor}x the running mean "
                      f"{mean:.4f}; the batch was read before data position {position}")
            logger.log(self.step, {"step": self.step, "loss_spike": loss, "loss_mean": mean, "data_position": position})
        self._loss_mean = loss if mean is None else 0.95 * mean + 0.05 * loss

    def _install_signal_handlers(self) -> dict:
        """SIGTERM and SIGUSR1 (preemption, SLURM's warning) ask for a checkpoint at the next step
        boundary; a second one exits at once."""
        if threading.current_thread() is not threading.main_thread():
            return {}

        def handler(signum: int, frame: Any) -> None:
            if self._stop_signal is not None:
                os._exit(128 + signum)
            self._stop_signal = signum

        return {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGUSR1)}

    @staticmethod
    def _restore_signal_handlers(previous: dict) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def _agree_to_stop(self) -> bool:
        """Whether any rank got a stop signal: all ranks must save and stop at the same step."""
        flag = torch.tensor(0.0 if self._stop_signal is None else 1.0, device=self.device)
        if self.mesh is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0 and self._stop_signal is None:
            self._stop_signal = -1  # another rank's signal
        return bool(flag.item() > 0)

    def _print_header(self) -> None:
        if not (self.is_main and self.cfg.metrics.console):
            return
        cfg, args = self.cfg, self.model_args
        n_params = self.num_params
        dtype = str(self.compute_dtype).replace("torch.", "")
        tok = f"tokenizer vocab {self.tokenizer.vocab_size}" if self.tokenizer else "synthetic tokens"
        self.console.print(
            f"[bold]ember train[/bold] {cfg.model.family} {cfg.model.flavor}: {n_params:,} params, "
            f"{args.n_layers} layers, dim {args.dim}, {tok} | {self.device.type} {dtype} | "
            f"global batch {cfg.global_batch_size} x seq {cfg.seq_len} "
            f"(micro {cfg.micro_batch_size} x accum {self.grad_accum}) | mesh {self.shape.describe()} | "
            f"peak {self._peak_str()} | "
            f"output {self.output_dir}"
        )
        self.console.print(f"data: {self.train_loader.describe()}", markup=False, highlight=False)
        if self.val_note:
            self.console.print(self.val_note, markup=False, highlight=False)

    def _peak_str(self) -> str:
        if self.peak_flops is None:
            return "unknown"
        return f"{self.peak_flops / 1e12:.2f} TFLOP/s ({self.peak_source})"


def run(cfg: JobConfig) -> dict:
    """Build a Trainer and train; the CLI's `ember train` and the tests call this."""
    return Trainer(cfg).train()
