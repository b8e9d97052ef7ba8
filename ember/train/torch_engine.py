"""The torch.distributed engine (device=cpu|cuda): this rank's model parallelized on a DeviceMesh, the micro-batch
forward/backward (ember/train/step.py, the pipeline schedule when pp > 1), gradient clipping and the optimizer step.

ember/train/trainer.py's Trainer owns everything else (data, health, metrics, evaluation, checkpoints);
ember/train/engines.py says which engine a `device` trains on and what that engine refuses. Build order, as the
Trainer calls it: `TorchEngine(cfg)` (the job's ranks and device) -> `connect(spec)` (process group, DeviceMesh)
-> `build(tokenizer)` (model, loss, optimizer) -> `place(restored)` after the checkpoint resume (nothing to do: DCP
loaded in place).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
from torch import nn

from ember.checkpoint.manager import CheckpointManager
from ember.config_schema import JobConfig
from ember.data.tokenizer import AnyTokenizer
from ember.eval.distributed import EvalRanks
from ember.finetune import dpo as dpo_lib, grpo as grpo_lib
from ember.hardware.cpu_allocator import keep_freed_cpu_memory
from ember.hardware.device import pick_device
from ember.hardware.peaks import PeakFlops, peak_flops
from ember.metrics.profiling import StepProfiler, phase
from ember.nn import moe as moe_lib
from ember.nn.moe_stats import MoEOptions, MoEStats, RouterLoss
from ember.parallel import fp8 as fp8_lib
from ember.parallel.mesh import ParallelMesh, init_distributed
from ember.train import fault_tolerance as ft_lib, run as run_lib
from ember.train.health import is_finite_step
from ember.train.optim import build_optimizer, clip_grad_norm_
from ember.train.run import RunSpec
from ember.train.step import Batch, ForwardBackward


class TorchEngine:
    """One rank of a torch.distributed job (or the only process); see the module docstring."""

    checkpoint_manager = None  # ember/checkpoint/manager.py's CheckpointManager: DCP over this rank's tensors

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.rank, self.world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        self.device = pick_device(cfg.device)
        self.run_device = self.device  # what the run's decisions and run.json name
        # A CPU step's buffers are reused instead of page-faulted in afresh each step (see the function).
        allocator_note = keep_freed_cpu_memory() if self.device.type == "cpu" else None
        self.notes: list[Optional[str]] = [allocator_note and f"cpu: {allocator_note}"]
        self.mesh: Optional[ParallelMesh] = None
        self.replicas: Optional[ft_lib.ReplicaGroups] = None  # fault_tolerance.enable: this group among its peers
        self.resumed_from = None  # the checkpoint this run resumed from
        self.diloco: Optional[Any] = None  # fault_tolerance.semi_sync=diloco: torchft's DiLoCo, entered
        self.diloco_outer: Optional[torch.optim.Optimizer] = None  # its outer optimizer (checkpointed)

    def connect(self, spec: RunSpec) -> None:
        """The process group and the DeviceMesh of `spec`'s layout; with fault tolerance, torchft's manager of this
        group's rank among the replica groups."""
        self.spec = spec
        if self.world_size > 1:
            init_distributed(self.device, self.cfg.parallel.timeout_s)
            self.mesh = ParallelMesh(spec.shape, self.device.type)
        ft = self.cfg.fault_tolerance
        if ft.enable:
            self.replicas = ft_lib.ReplicaGroups(ft, ft_lib.group_from_env(ft), self.rank, self.world_size,
                                                 self.device, self.cfg.output_dir, self.cfg.max_steps)
            self.notes.append(f"replica group {self.replicas.group} of {ft.replica_groups} (fault_tolerance, "
                              f"{'DiLoCo' if ft.semi_sync == 'diloco' else 'gradients averaged every step'})")

    def peak(self) -> PeakFlops:
        """The peak for MFU, taken while the ranks are in step (just past the job's start) and nothing else runs: on
        CPU it is measured once per machine, and a measurement among busy ranks would read low. FP8 runs are
        measured against the device's fp8 peak (the header says which)."""
        spec = self.spec
        return peak_flops(self.device, torch.float8_e4m3fn if spec.parallel.fp8_recipe else spec.compute_dtype,
                          self.cfg.metrics.peak_tflops)

    def build(self, tokenizer: Optional[AnyTokenizer]) -> None:
        """This rank's pipeline stages, parallelized on meta, then materialised (ember/train/run.py); the loss (DPO's
        with its reference), the pipeline schedule, the optimizer."""
        cfg, spec = self.cfg, self.spec
        # The MoE layers' router losses weigh the whole model's MoE layers and the step's tokens; their statistics
        # go to this engine's collector, which the step, the score-bias update and the metrics read.
        args = spec.args
        n_moe_layers = sum(args.is_moe_layer(i) for i in range(args.n_layers))
        self.moe_stats = MoEStats()
        router_loss = RouterLoss.for_step(cfg.model.aux_loss_coef, cfg.model.z_loss_coef,
                                          cfg.global_batch_size * cfg.seq_len, n_moe_layers)
        built = run_lib.build_model(spec, self.mesh, moe=MoEOptions(router_loss=router_loss, stats=self.moe_stats))
        self.model_parts: list[nn.Module] = built.parts
        self.whole = built.whole  # on meta: counts that are the whole model's, not a stage's
        # One module for the optimizer, clipping and `model.train()`: the model, or this rank's stages.
        self.model = self.model_parts[0] if len(self.model_parts) == 1 else nn.ModuleList(self.model_parts)
        # The whole model's, so every rank (a pipeline stage without such routers too) joins the update's all_sum.
        self.score_bias_rate = cfg.model.bias_update_rate if moe_lib.has_score_bias([built.whole]) else 0.0
        eos_id = tokenizer.eos_id if cfg.data.document_mask else None
        self.dpo = dpo_lib.dpo_objective(spec, self.mesh, self.model) if cfg.task == "dpo" else None
        self.forward_backward = ForwardBackward(self.model, self.mesh, self.device, autocast_dtype=spec.autocast_dtype,
                                                loss_parallel=spec.parallel.loss_parallel,
                                                cp_impl=spec.parallel.cp_impl, eos_id=eos_id,
                                                output_chunks=spec.output_chunks, fused_output=spec.fused_output,
                                                dpo=self.dpo)
        # task=grpo: rollouts from this model and its update, through forward_backward's mesh and autocast
        self.grpo = (grpo_lib.GRPOStep(spec, self.mesh, self.model, tokenizer, self.forward_backward)
                     if cfg.task == "grpo" else None)
        if spec.num_stages > 1:
            self.forward_backward.build_pipeline(built.stages, spec.num_stages, cfg.parallel.pp_schedule,
                                                 spec.pp_microbatches)
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device.type)
        self.fp8_after_step = (fp8_lib.fp8_after_optimizer_step(self.model_parts, self.mesh, spec.parallel.fp8_recipe)
                               if spec.parallel.fp8_recipe else None)

    def data_shard(self) -> tuple[int, int, int]:
        """(rows per micro-batch, data-parallel coordinate, data-parallel width) this rank's loaders read: ranks of
        one replica (tensor, pipeline, context) read the same batch. Replica group g reads the g-th share."""
        dp_rank, dp = self.mesh.dp_rank if self.mesh else 0, self.spec.shape.dp
        group = self.replicas.group if self.replicas is not None else 0
        return self.cfg.micro_batch_size, group * dp + dp_rank, dp * ft_lib.replica_groups(self.cfg)

    def place(self, checkpointer: CheckpointManager) -> None:
        """The weights are where they train already: DCP loaded a resume into this rank's tensors."""
        self.resumed_from = checkpointer.resumed_from  # (DiLoCo reads its outer momentum there at its start)

    # ---------------------------------------------------------------- one step
    def train_step(self, micro_batches: list[Batch]) -> tuple[float, float]:
        """Forward/backward over this rank's micro-batches of one global batch, clip, step (a non-finite step
        changes no weight: loss and norm are global, so every rank takes the same decision). Over replica groups
        (not DiLoCo), the gradients and loss are first averaged over the step's quorum, and the optimizer steps
        only if the step commits (`replicas.committed`)."""
        self.model.train()
        if self.replicas is not None and self.cfg.fault_tolerance.semi_sync == "diloco" and self.diloco is None:
            # at the first step: DiLoCo keeps the weights it syncs against, so after a resume and the first quorum
            self.diloco, self.diloco_outer = ft_lib.diloco(self.replicas, self.model, self.optimizer,
                                                           self.resumed_from, self.world_size)
        if self.grpo is not None:  # micro_batches are GRPO's slots of a rollout batch (ember/finetune/grpo.py)
            loss = self.grpo.run(micro_batches)
        else:
            loss = self.forward_backward.run(micro_batches, backward=True)
        self.moe_stats.end_step(len(micro_batches) * self.spec.pp_microbatches)
        synced = self.replicas is not None and self.diloco is None
        if synced:
            with phase("replica_sync"):
                loss = float(self.replicas.average(torch.tensor(loss), self.model.parameters()))
        with phase("optimizer"):
            grad_norm = float(clip_grad_norm_(self.model.parameters(), self.cfg.optim.max_grad_norm,
                                              pp_mesh=self.mesh.submesh("pipeline") if self.mesh else None))
            # every group's verdict on the step (a collective: asked even of a non-finite one)
            if (not synced or self.replicas.commit()) and is_finite_step(loss, grad_norm):
                self.optimizer.step()
                if self.score_bias_rate:
                    self.moe_stats.update_score_bias(self.model_parts, self.score_bias_rate, self.spec.args.n_layers,
                                                     self.spec.args.n_experts, self.all_sum, self.device)
                if self.fp8_after_step is not None:
                    self.fp8_after_step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss, grad_norm

    @torch.no_grad()
    def evaluate(self, micro_batches: list[Batch]) -> Optional[float]:
        """The mean validation loss over `micro_batches` (None: a pipeline schedule without an eval form)."""
        schedule = self.forward_backward.schedule
        if schedule is not None and not hasattr(schedule, "eval"):
            return None
        self.model.eval()
        loss = self.forward_backward.run(micro_batches, backward=False)
        self.model.train()
        return loss

    def scoring_model(self) -> tuple[nn.Module, EvalRanks]:
        """The module eval.tasks score with, and how the requests are shared out: over the data-parallel ranks
        (the engine's rules allow only layouts where each rank runs the whole model: data, fsdp, expert)."""
        return self.model, EvalRanks(self.mesh.dp_rank if self.mesh else 0, self.spec.shape.dp)

    def all_sum(self, value: torch.Tensor) -> torch.Tensor:
        """A host tensor summed over every rank (the MoE metrics' one reduction)."""
        return self.forward_backward.all_sum(value)

    def device_memory(self, record: dict[str, Any]) -> None:
        """record's memory_gb is already this device's (ember/metrics/run_metrics.py)."""

    def profiler(self, output_dir: Any, say: Any) -> StepProfiler:
        """profile.*'s tracer of this run's steps (torch.profiler)."""
        cfg = self.cfg
        return StepProfiler(cfg.profile.enabled, cfg.profile.step, cfg.profile.steps, output_dir, self.rank,
                            self.device, say)

    def window_metrics(self, record: dict[str, Any]) -> dict[str, Any]:
        """Over the logging window: DPO's reward margin, accuracy and rewards; GRPO's rewards, lengths, clipping,
        KL, entropy and rollout/update times, with `record`'s throughput in the tokens GRPO processed."""
        if self.grpo is not None:
            return self.grpo.pop_metrics(record)
        return self.dpo.pop_metrics() if self.dpo is not None else {}
