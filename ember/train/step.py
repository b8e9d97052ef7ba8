"""The forward and backward of one rank's micro-batches: loss math, context-parallel sequence cuts, the
pipeline schedule, autocast and loss parallelism: the torch engine's loss (ember/train/torch_engine.py). The XLA
engine's compiled step (ember/xla/step.py) computes the same loss with the same weighting in jax.

The loss of a step is the mean over every target token of the global batch: each micro-batch contributes
its *sum* of token losses divided by the global token count, so unequal micro-batches (masked labels)
weigh correctly, gradient accumulation needs no extra scaling, and data-parallel gradient reductions sum
(parallel/fsdp.py) instead of averaging.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ember.constants import IGNORE_INDEX
from ember.metrics.profiling import phase
from ember.nn.attention import document_layout
from ember.nn.loss import cross_entropy_sum, linear_cross_entropy_sum
from ember.parallel import cp as cp_lib, pp as pp_lib
from ember.parallel.mesh import ParallelMesh

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

    from ember.finetune.dpo import DPOObjective

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, labels), each (B, T)


def _is_dtensor(x: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


def token_loss_sum(logits: Union[torch.Tensor, list[torch.Tensor]], labels: torch.Tensor,
                   scale: float = 1.0) -> torch.Tensor:
    """`scale` times the summed token cross-entropy, in fp32; logits (B, T, V), or the model's list of chunks
    of them. Backpropagate the result itself: the gradient is scaled already (ember.nn.loss)."""
    if _is_dtensor(logits):  # vocabulary-sharded logits (loss parallel): DTensor's cross-entropy
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=IGNORE_INDEX,
                               reduction="sum") * scale
    return cross_entropy_sum(logits, labels, scale)


def _fused_loss(h: torch.Tensor, weight: torch.Tensor, softcap: Optional[float], *, labels: torch.Tensor,
                scale: float, chunks: int) -> torch.Tensor:
    """The model's output_fn for the fused path: its final hidden states and output matrix to the loss."""
    return linear_cross_entropy_sum(h, weight, labels, scale, chunks, softcap)


class ForwardBackward:
    """Runs this rank's share of micro-batches through the model (or its pipeline stages)."""

    def __init__(self, model: nn.Module, mesh: Optional[ParallelMesh], device: torch.device, *,
                 autocast_dtype: Optional[torch.dtype], loss_parallel: bool, cp_impl: str,
                 eos_id: Optional[int] = None, output_chunks: int = 1, fused_output: bool = False,
                 dpo: Optional[DPOObjective] = None):
        """autocast_dtype: None for no autocast (fp32, or FSDP's mixed precision casting instead);
        eos_id: set for document masking (attention within packed documents, positions restart);
        output_chunks: the logits in this many sequence chunks (ember.nn.loss.output_chunks; whole-sequence logits);
        fused_output: the loss fused with the output projection in that many row chunks (RunSpec.fused_output);
        dpo: an ember.finetune.dpo.DPOObjective for task=dpo: micro-batches are preference pairs and the loss is
        the mean DPO loss over the global batch's pairs instead of the mean token loss."""
        self.model, self.mesh, self.device, self.dpo = model, mesh, device, dpo
        self.autocast_dtype, self.loss_parallel, self.cp_impl, self.eos_id = (autocast_dtype, loss_parallel, cp_impl,
                                                                              eos_id)
        self.output_chunks = output_chunks
        self.fused_output = fused_output
        output = getattr(model, "output", None)
        plain_projection = output is not None and getattr(output.forward, "__func__", None) is nn.Linear.forward
        if fused_output and (not plain_projection or dpo is not None):
            # RunSpec.fused_output holds only where nothing replaces the projection (LoRA adapts blocks only, FP8
            # keeps the output high precision, TP and DPO are excluded): a change there must not fall back silently
            raise ValueError("fused_output needs a plain nn.Linear output projection and no DPO objective")
        degree = (lambda axis: mesh.shape.degree(axis)) if mesh is not None else (lambda axis: 1)
        self.tp, self.pp, self.cp = degree("tensor"), degree("pipeline"), degree("context")
        self.schedule: Optional[Union[PipelineScheduleSingle, PipelineScheduleMulti]] = None
        self.has_first_stage = self.has_last_stage = True
        self._pp_scale = 1.0

    def build_pipeline(self, stages: list[tuple[int, nn.Module]], num_stages: int, schedule: str,
                       n_microbatches: int) -> None:
        """Run through torch.distributed.pipelining from now on: `stages` are this rank's (stage id, module)."""
        self.schedule = pp_lib.build_schedule(stages, num_stages, self.device, self.mesh.submesh("pipeline"),
                                              schedule, n_microbatches, self._pipeline_loss)
        ids = [sid for sid, _ in stages]
        self.has_first_stage, self.has_last_stage = 0 in ids, num_stages - 1 in ids

    def all_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a tensor over every rank, in place (a no-op on one process)."""
        if self.mesh is not None:
            dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return value

    def global_token_count(self, micro_batches: list[Batch]) -> int:
        """Target tokens in the global batch: each replica's count, summed over the data-parallel ranks
        (the tensor, pipeline and context ranks of a replica hold the same labels, so they divide out)."""
        if self.dpo is not None:  # preference pairs: a micro-batch of B pairs is 2B rows
            local = sum(inputs.shape[0] // 2 for inputs, _ in micro_batches)
        else:
            local = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in micro_batches)
        total = self.all_sum(torch.tensor(float(local), device=self.device))
        return round(float(total) / (self.tp * self.pp * self.cp))

    def run(self, micro_batches: list[Batch], backward: bool) -> float:
        """The mean token loss of the global batch whose share `micro_batches` is; with backward, its
        gradients accumulate in the parameters. Every rank gets the same number."""
        scale = 1.0 / max(self.global_token_count(micro_batches), 1)
        loss_total = torch.zeros((), device=self.device)
        self._dpo_stats = torch.zeros(5, device=self.device)
        for inputs, labels in micro_batches:
            if self.schedule is not None:
                loss_total += self._pipeline_loss_sum(inputs, labels, scale, backward)
            else:
                loss_total += self._loss_sum(inputs, labels, scale, backward)
        if self.dpo is not None and backward:  # the training steps' pair statistics, for the metrics line
            self.dpo.record(self.all_sum(self._dpo_stats) / self.tp)
        # Every rank's share summed; tensor-parallel ranks each hold the whole replica's loss.
        return float(self.all_sum(loss_total) / self.tp)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward's autocast (also GRPO's rollouts and no-grad log-probs, and the planner's measured step)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _loss_context(self) -> contextlib.AbstractContextManager:
        # Cross-entropy on vocabulary-sharded logits, forward and backward, when tensor parallel.
        if self.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def _loss_sum(self, inputs: torch.Tensor, labels: torch.Tensor, scale: float, backward: bool) -> torch.Tensor:
        """The summed token loss of this rank's share of one micro-batch, times `scale`; with backward, its
        gradients too. Context parallelism cuts the sequence here."""
        inputs = inputs.to(self.device, non_blocking=True)
        labels = labels.to(self.device, non_blocking=True)
        positions = document_ids = None
        if self.eos_id is not None:
            document_ids, positions = document_layout(inputs, self.eos_id)
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
            if self.fused_output:  # the loss and both of the projection's gradients come out of the forward
                fused = partial(_fused_loss, labels=labels, scale=scale, chunks=self.output_chunks)
                with self.autocast(), phase("forward"):
                    loss = self.model(inputs, positions, document_ids, output_fn=fused)
                if backward:
                    with phase("backward"):
                        loss.backward()
                return loss.detach()
            with self.autocast(), phase("forward"):
                logits = self.model(inputs, positions, document_ids, chunks=self.output_chunks)  # (B, T, V)
            if self.dpo is not None:
                loss, stats = self.dpo.loss_sum(logits, inputs, labels, positions, document_ids, self.autocast)
                loss = loss * scale
                self._dpo_stats += stats
            else:
                loss = token_loss_sum(logits, labels, scale)
            if backward:
                with phase("backward"):
                    loss.backward()  # MoE router losses join in their layers (ember.nn.moe.attach_router_loss)
        return loss.full_tensor().detach() if _is_dtensor(loss) else loss.detach()

    def _pipeline_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return token_loss_sum(logits, labels, self._pp_scale)

    def _pipeline_loss_sum(self, inputs: torch.Tensor, labels: torch.Tensor, scale: float,
                           backward: bool) -> torch.Tensor:
        """The same through the pipeline schedule: the last stage computes the loss per pipeline
        micro-batch; other stages report 0."""
        self._pp_scale = scale
        args = (inputs.to(self.device),) if self.has_first_stage else ()
        losses: list[torch.Tensor] = []
        step = self.schedule.step if backward else self.schedule.eval
        # forward and backward interleaved by the schedule, in this thread: autocast covers the stages' forwards
        with self.autocast(), phase("pipeline_step"):
            step(*args, target=labels.to(self.device), losses=losses)
        if self.has_last_stage and losses:
            return torch.stack([loss.detach() for loss in losses]).sum()
        return torch.zeros((), device=self.device)
