"""The Trainer: build everything in a fixed order, then run the loop. Read it top to bottom.

Build order (docs/architecture.md): mesh -> tokenizer -> model on meta -> pipeline split -> parallelize ->
to_empty -> init_weights -> init_from -> forward/backward -> optimizer -> data -> checkpoint resume.
The loss math lives in ember/step.py, run health and stop signals in ember/health.py, MoE bookkeeping in
ember/nn/moe.py.
"""

from __future__ import annotations

import collections
import functools
import math
import os
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch import nn
from rich.console import Console

from ember import config as config_lib
from ember import run as run_lib
from ember import run_history
from ember.checkpoint import (CheckpointError, CheckpointManager, archive_previous_run, meta_for, rng_state,
                              set_rng_state, starts_over)
from ember.config import ConfigError, JobConfig
from ember.errors import DataError
from ember.eval.distributed import EvalRanks
from ember.eval.tasks import run_tasks
from ember.finetune import base_fingerprint
from ember.finetune import dpo as dpo_lib
from ember.parallel import fp8 as fp8_lib
from ember.profiling import StepProfiler, phase
from ember.finetune import lora as lora_lib
from ember.data.loader import build_loader
from ember.data.tokenizer import build_tokenizer
from ember.hardware import keep_freed_cpu_memory, peak_flops, pick_compute_dtype, pick_device, raise_measured_peak
from ember.health import HealthGuard, StopSignals, TrainingStopped
from ember.load import load_weights
from ember.metrics import MetricsLogger, plural, progress_bar, throughput_record
from ember.models import MODELS
from ember.nn import moe as moe_lib
from ember.nn.loss import output_chunks
from ember.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_, restart_schedule
from ember.parallel import pp as pp_lib
from ember.parallel.mesh import ParallelMesh, init_distributed
from ember.parallel.parallelize import init_weights, parallelize
from ember.step import Batch, ForwardBackward

__all__ = ["Trainer", "TrainingStopped", "run"]


class Trainer:
    """Owns the model, optimizer, data and metrics of one run, on one process or as one rank of many."""

    def __init__(self, cfg: JobConfig, console: Optional[Console] = None):
        self.cfg = cfg
        # soft_wrap: a metrics line stays one line in logs and pipes, whatever the terminal width.
        self.console = console or Console(soft_wrap=True)
        self.rank, self.world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        self.is_main = self.rank == 0
        self.device = pick_device(cfg.device)
        # A CPU step's buffers are reused instead of page-faulted in afresh each step (see the function).
        self.allocator_note = keep_freed_cpu_memory() if self.device.type == "cpu" else None
        self.compute_dtype = pick_compute_dtype(cfg.precision, self.device, frozen_base=cfg.lora.rank > 0)
        self.fp8_recipe = cfg.fp8.recipe if config_lib.fp8_enabled(cfg) else None
        if self.fp8_recipe:
            fp8_lib.check_fp8_device(self.device, cfg.fp8.emulate)
        self.output_dir = Path(cfg.output_dir)

        # 1. The mesh: ici x dcn degrees checked against the world, then one DeviceMesh for the job.
        self.shape = config_lib.mesh_shape(cfg, self.world_size)
        self.mesh: Optional[ParallelMesh] = None
        if self.world_size > 1:
            init_distributed(self.device, cfg.parallel.timeout_s)
            self.mesh = ParallelMesh(self.shape, self.device.type)
        self.tp, self.pp, self.cp = (self.shape.degree(a) for a in ("tensor", "pipeline", "context"))
        # The loader reads by data-parallel coordinate: ranks of one replica (tensor, pipeline, context)
        # read the same batch.
        self.dp_rank, self.dp_world = (self.mesh.dp_rank if self.mesh else 0), self.shape.dp
        self.grad_accum = config_lib.grad_accum_steps(cfg, self.dp_world)
        torch.manual_seed(cfg.seed)
        # The peak for MFU now, while the ranks are in step (just past the job's start) and nothing else runs:
        # on CPU it is measured once per machine, and a measurement among busy ranks would read low.
        # FP8 runs are measured against the device's fp8 peak (the header says which).
        self.peak = peak_flops(self.device, torch.float8_e4m3fn if self.fp8_recipe else self.compute_dtype,
                               cfg.metrics.peak_tflops)

        # 2. Tokenizer first: the model's vocabulary must cover it, and that is a config error, not a crash.
        self.spec = MODELS[cfg.model.family]
        # With model.init_from the architecture is the source's (config.json / model.json), checked at config time.
        self.model_choice = config_lib.model_choice(cfg)
        self.model_args = self.model_choice.args
        self.tokenizer = build_tokenizer(cfg.data, self.model_args.vocab_size) if cfg.data.dataset != "synthetic" else None

        # 3. Model: meta -> (pipeline split) -> parallelize -> to_empty -> init_weights, so 405B never
        # materialises on one host. Each rank builds only its pipeline stages.
        cp_impl = cfg.parallel.cp_impl if cfg.parallel.cp_impl != "auto" else ("ring" if self.device.type == "cuda" else "allgather")
        self._check_device_options(cp_impl)
        # FSDP's mixed precision (bf16 compute, fp32 gradient reduction) replaces autocast where FSDP runs.
        # Both decisions are ember/run.py's, which `ember plan` calls too.
        self.fsdp_mixed = run_lib.uses_fsdp_mixed_precision(cfg, self.shape, self.compute_dtype)
        loss_parallel = run_lib.uses_loss_parallel(cfg, self.shape)
        stages, num_stages, whole = self._build_model(cp_impl, loss_parallel)
        self.model_parts: list[nn.Module] = [part for _, part in stages]
        # One module for the optimizer, clipping and `model.train()`: the model, or this rank's stages.
        self.model = self.model_parts[0] if len(self.model_parts) == 1 else nn.ModuleList(self.model_parts)
        self.num_params = sum(p.numel() for p in whole.parameters())
        # LoRA: the frozen weights skip their weight gradients; DPO: the reference's forward over every row
        self.flops_per_token = lora_lib.run_flops_per_token(cfg, self.spec, self.model_args, self.compute_dtype)
        n_moe_layers = len(whole.moe_layers())  # the whole model's, not a stage's
        self.n_experts = getattr(self.model_args, "n_experts", 0) if n_moe_layers else 0
        for part in self.model_parts:
            moe_lib.set_router_loss(part, cfg.model.aux_loss_coef, cfg.model.z_loss_coef,
                                    cfg.global_batch_size * cfg.seq_len, max(n_moe_layers, 1))

        # 4. Forward/backward (the pipeline schedule when pp > 1), optimizer, LR schedule.
        eos_id = self.tokenizer.eos_id if cfg.data.document_mask else None
        autocast = None if self.compute_dtype == torch.float32 or self.fsdp_mixed else self.compute_dtype
        self.forward_backward = ForwardBackward(self.model, self.mesh, self.device, autocast_dtype=autocast,
                                                loss_parallel=loss_parallel, cp_impl=cp_impl, eos_id=eos_id,
                                                dpo=self._dpo_objective(cp_impl, loss_parallel))
        self.pp_microbatches = 1  # forwards of each layer per micro-batch
        if self.pp > 1:
            pp_mb = cfg.parallel.pp_microbatches
            self.pp_microbatches = cfg.micro_batch_size if pp_mb == -1 else pp_mb
            self.forward_backward.build_pipeline(stages, num_stages, cfg.parallel.pp_schedule, self.pp_microbatches)
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device.type)
        self.fp8_after_step = (fp8_lib.fp8_after_optimizer_step(self.model_parts, self.mesh, self.fp8_recipe)
                               if self.fp8_recipe else None)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.schedule, cfg.max_steps)

        # 5. Data, read by this rank's data-parallel coordinate.
        loader_kwargs = dict(seq_len=cfg.seq_len, micro_batch_size=cfg.micro_batch_size, dp_rank=self.dp_rank,
                             dp_world=self.dp_world, seed=cfg.seed, vocab_size=self.model_args.vocab_size)
        make_loader = build_loader if cfg.task == "lm" else functools.partial(dpo_lib.build_pair_loader, dpo_cfg=cfg.dpo)
        self.train_loader = make_loader(cfg.data, self.tokenizer, split="train", **loader_kwargs)
        self.val_loader, self.val_note = None, None
        try:
            self.val_loader = make_loader(cfg.data, self.tokenizer, split="val", **loader_kwargs)
        except DataError as err:  # a held-out split too small for one batch: train without validation
            self.val_note = f"no validation: {err}"
        # The header, once the model and data are known: before what starting over, resuming or a tracker prints.
        self._print_header()

        # 6. Metrics, health, checkpoints: resume restores weights, optimizer, schedule, data position and RNG.
        self.step = 0
        self.last_step_skipped = False
        self.health = HealthGuard(cfg.max_skipped_steps, cfg.loss_spike_factor, self._say)
        if starts_over(cfg.resume, self.output_dir):
            archive_previous_run(self.output_dir, self._say)
        meta = meta_for(cfg.model.family, self.model_choice.flavor, self.model_args)
        if cfg.lora.rank:  # a LoRA checkpoint holds the adapters and their optimizer state, and names its base
            meta.update(lora_lib.lora_meta(cfg.lora, cfg.model.init_from))
        elif cfg.task == "dpo" and cfg.model.init_from:  # the reference is rebuilt from model.init_from on resume
            meta.update(base_fingerprint.reference_meta(cfg.model.init_from))
        self.checkpointer = CheckpointManager(cfg.checkpoint, self.output_dir, self.model_parts, self.model,
                                              self.optimizer, meta, say=self._say, adapters_only=bool(cfg.lora.rank),
                                              run_config=run_history.config_dict(cfg),
                                              allow_changes=cfg.resume_allow_changes)
        try:
            state = self.checkpointer.resume(cfg.resume)
        except CheckpointError as err:
            raise ConfigError(str(err)) from None
        if state is not None:
            self.step = int(state["step"])
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
            restart_schedule(self.lr_scheduler)  # this run's optim.lr and schedule, from the resumed step on
            self.train_loader.load_state_dict(state["data"])
            set_rng_state(state["rng"])
            self.health.load_state_dict(state)

    def _check_device_options(self, cp_impl: str) -> None:
        if self.cp > 1 and cp_impl == "ring" and self.device.type != "cuda":
            raise ConfigError("parallel.cp_impl=ring needs CUDA (SDPA's CPU kernel has no ring form); use allgather")
        if self.cfg.parallel.cpu_offload and (self.device.type != "cuda" or self.shape.grad_sync == 1):
            raise ConfigError("parallel.cpu_offload moves FSDP-sharded parameters and optimizer state from the GPU "
                              "to host memory; it needs device=cuda and a data/fsdp axis > 1 (on CPU they are already there)")

    def _build_model(self, cp_impl: str, loss_parallel: bool) -> tuple[list[tuple[int, nn.Module]], int, nn.Module]:
        """This rank's (stage id, module) parts, the number of pipeline stages, and the whole model on meta."""
        cfg, par = self.cfg, self.cfg.parallel
        build = lambda: self.spec.model_cls(self.model_args)  # noqa: E731
        lora = lora_lib.lora_transform(cfg, self.compute_dtype)
        with torch.device("meta"):
            whole = build()
        if self.pp > 1:
            num_stages = self.pp * par.pp_stages_per_rank
            ids = pp_lib.stage_ids(self.mesh.coordinate("pipeline"), self.pp, par.pp_stages_per_rank)
            stages = [(sid, pp_lib.split_model(whole, sid, num_stages)) for sid in ids]
        else:
            num_stages, stages = 1, [(0, whole)]
        for _, part in stages:
            parallelize(
                part, self.mesh, self.spec.tp_plan, compile=cfg.compile, remat=cfg.model.remat,
                remat_every=cfg.model.remat_every, param_dtype=self.compute_dtype if self.fsdp_mixed else None,
                reduce_dtype=torch.float32 if self.fsdp_mixed else None,
                reshard_after_forward=par.reshard_after_forward, cpu_offload=par.cpu_offload,
                loss_parallel=loss_parallel, cp_impl=cp_impl,
                flex_attention=cfg.data.document_mask and self.device.type == "cuda", lora=lora,
                fp8_recipe=self.fp8_recipe, fp8_emulate=cfg.fp8.emulate,
            )
            # With CPU offload FSDP keeps the sharded parameters in host memory and moves them itself.
            part.to_empty(device="cpu" if par.cpu_offload else self.device)
            part.tie_weights()  # to_empty gives each module its own Parameter
        if self.tp == 1 and self.pp == 1:  # plain-tensor logits of the whole sequence: compute them in chunks
            whole.output_chunks = output_chunks(cfg.micro_batch_size, cfg.seq_len // self.cp,
                                                self.model_args.vocab_size, self.device.type)

        def build_on_meta() -> nn.Module:
            with torch.device("meta"):
                return build()

        init_weights([part for _, part in stages], build_on_meta, cfg.seed, self.device, self.mesh is not None)
        if cfg.model.init_from:  # on resume, the base of a LoRA or DPO checkpoint: a failure says so
            with base_fingerprint.resumed_base(cfg.resume, self.output_dir, cfg.model.init_from):
                load_weights([part for _, part in stages], cfg.model.init_from)
        if lora is not None:
            lora_lib.init_lora([part for _, part in stages], cfg.seed)
        return stages, num_stages, whole

    def _dpo_objective(self, cp_impl: str, loss_parallel: bool) -> Optional[dpo_lib.DPOObjective]:
        """task=dpo's loss, with the frozen starting model as its reference: under LoRA the policy with its adapters
        off (no second model in memory); otherwise a second copy of the starting weights, built and sharded as
        the policy is (its init and model.init_from, never the resumed checkpoint)."""
        if self.cfg.task != "dpo":
            return None
        if self.cfg.lora.rank:
            model = self.model

            def reference(*inputs: Any) -> Any:
                with lora_lib.lora_disabled(model):
                    return model(*inputs)
        else:
            stages, _, _ = self._build_model(cp_impl, loss_parallel)
            reference = stages[0][1].requires_grad_(False).eval()
        return dpo_lib.DPOObjective(self.cfg.dpo.beta, reference)

    def _say(self, message: str) -> None:
        if self.is_main:
            self.console.print(message, markup=False, highlight=False)

    def train_state(self) -> dict:
        """This rank's part of a checkpoint beside the DCP weights and optimizer state."""
        return {"step": self.step, "lr_scheduler": self.lr_scheduler.state_dict(),
                "data": self.train_loader.state_dict(), "rng": rng_state(), **self.health.state_dict()}

    # ---------------------------------------------------------------- one optimizer step
    def global_batches(self) -> Iterator[list[Batch]]:
        """This rank's micro-batches of each global batch, endlessly (grad_accum of them per step)."""
        train_iter = iter(self.train_loader)
        while True:
            yield [next(train_iter) for _ in range(self.grad_accum)]

    def train_step(self, micro_batches: list[Batch]) -> tuple[float, float]:
        """Forward/backward over this rank's micro-batches of one global batch, clip, step."""
        self.model.train()
        loss = self.forward_backward.run(micro_batches, backward=True)
        for part in self.model_parts:
            moe_lib.end_moe_step(part, len(micro_batches) * self.pp_microbatches)
        with phase("optimizer"):
            grad_norm = float(clip_grad_norm_(self.model.parameters(), self.cfg.optim.max_grad_norm,
                                              pp_mesh=self.mesh.submesh("pipeline") if self.mesh else None))
            # Both are global, so every rank takes the same decision: a non-finite step changes no weight.
            self.last_step_skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
            if not self.last_step_skipped:
                self.optimizer.step()
                if self.fp8_after_step is not None:
                    self.fp8_after_step()
            self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        return loss, grad_norm

    @torch.no_grad()
    def evaluate(self) -> Optional[float]:
        schedule = self.forward_backward.schedule
        if self.val_loader is None or (schedule is not None and not hasattr(schedule, "eval")):
            return None
        self.model.eval()
        self.val_loader.reset()  # the same validation batches every time, so evaluations compare
        val_iter = iter(self.val_loader)
        # eval_batches global batches, whatever the layout: each rank reads its share of the same samples.
        loss = self.forward_backward.run([next(val_iter) for _ in range(self.cfg.eval_batches * self.grad_accum)],
                                         backward=False)
        self.model.train()
        return loss

    def eval_tasks(self) -> dict[str, float]:
        """eval.tasks as eval/<task>/<metric>; the requests are shared out over the data-parallel ranks (config
        allows only layouts where each rank runs the whole model: data, fsdp, expert)."""
        results = run_tasks(self.model, self.tokenizer, self.cfg.eval.tasks, self.cfg.eval.limit, self.cfg.eval.batch_size,
                            EvalRanks(self.dp_rank, self.dp_world))
        self.model.train()
        return results

    # ---------------------------------------------------------------- the loop
    def train(self) -> dict:
        cfg = self.cfg
        if self.step >= cfg.max_steps:  # a finished run asked again: no segment, record, evaluation or checkpoint
            self._say(f"already at step {self.step} of max_steps={cfg.max_steps}: nothing to train, nothing written "
                      "(raise max_steps to continue, or resume=none to start over)")
            self._close_loaders()
            return {"first_loss": None, "final_loss": None, "final_loss_avg": None, "final_loss_steps": None,
                    "val_loss": None, "steps": self.step, "checkpoint": str(self.checkpointer.resumed_from),
                    "stopped_by_signal": None, "skipped_steps": self.health.skipped_total, "eval": {}}
        self.output_dir.mkdir(parents=True, exist_ok=True)
        # config.yaml is this segment's; config_history/ keeps every segment's (ember/run_history.py). The trackers
        # read config.yaml when they start; a start refused before the first step takes the segment back.
        segment = (run_history.SegmentStart(self.output_dir, cfg, self.step, self.checkpointer.resumed_from,
                                            self.checkpointer.changes) if self.is_main else None)
        try:
            logger = MetricsLogger(self.output_dir, cfg.metrics, enabled=self.is_main, console=self.console,
                                   start_step=self.step, run_info={"device": self.device, "mesh": self.shape.describe(),
                                                                   "world_size": self.world_size,
                                                                   "params": self.num_params,
                                                                   "compute": self._compute_description(),
                                                                   "model": self._built_model()})
        except BaseException:
            if segment is not None:
                segment.undo()
            raise
        tokens_per_step = cfg.global_batch_size * cfg.seq_len * (2 if cfg.task == "dpo" else 1)  # DPO: pairs of rows
        recent: collections.deque = collections.deque(maxlen=cfg.logging_steps)  # (step, loss) of the last good steps
        window = {"time": 0.0, "steps": 0, "loss": 0.0, "data": 0.0}
        first: Optional[tuple[int, float]] = None  # (step, loss) of this run's first good step
        batches = self.global_batches()
        progress = progress_bar(self.console, enabled=self.is_main and cfg.metrics.console)
        stopped = False
        # The main rank prints the summary; every rank writes its trace.
        profiler = StepProfiler(cfg.profile.enabled, cfg.profile.step, cfg.profile.steps, self.output_dir, self.rank,
                                self.device, self._say)
        profiler.plan(self.step, cfg.max_steps)  # says what max_steps or a resume cuts from the traced steps
        with progress, StopSignals(self.device, self.mesh is not None, self._say) as signals:
            task = progress.add_task("train", total=cfg.max_steps, loss="-", completed=self.step)
            while self.step < cfg.max_steps:
                profiler.start_step(self.step + 1)
                with profiler.step_range(self.step + 1):
                    t0 = time.perf_counter()
                    with phase("data_wait"):
                        micro_batches = next(batches)
                    data_wait = time.perf_counter() - t0  # time the step waited for the loader
                    lr = self.optimizer.param_groups[0]["lr"]
                    loss, grad_norm = self.train_step(micro_batches)
                    if self.device.type == "cuda":
                        torch.cuda.synchronize()
                    step_time = time.perf_counter() - t0
                self.step += 1
                progress.update(task, advance=1, **({} if self.last_step_skipped else {"loss": f"{loss:.3f}"}))
                if self.last_step_skipped:
                    logger.log(self.step, self.health.skipped(self.step, loss, grad_norm, self._save_now))
                    continue
                spike = self.health.good_step(self.step, loss, self.train_loader.state_dict())
                if spike is not None:
                    logger.log(self.step, spike)
                first = (self.step, loss) if first is None else first
                recent.append((self.step, loss))
                window["time"] += step_time
                window["steps"] += 1
                window["loss"] += loss
                window["data"] += data_wait
                if self.step % cfg.logging_steps == 0 or self.step == cfg.max_steps:
                    record = self._metrics_record(loss, lr, grad_norm, window, tokens_per_step)
                    logger.log(self.step, record)
                    window = {"time": 0.0, "steps": 0, "loss": 0.0, "data": 0.0}
                # Validation on its own cadence, outside the timed window of the step it follows.
                if cfg.eval_interval and self.step % cfg.eval_interval == 0 and self.step < cfg.max_steps:
                    logger.log(self.step, {"step": self.step, "val_loss": self.evaluate(), **self.eval_tasks()})
                self.checkpointer.poll()
                if signals.agree_to_stop():
                    self._say(f"{signals.describe()}: saving a checkpoint at step {self.step} and exiting")
                    self._save_now()
                    stopped = True
                    break
                if self.checkpointer.due(self.step) and self.step < cfg.max_steps:
                    with phase("checkpoint"):
                        self.checkpointer.save(self.step, self.train_state())
        profiler.finish(self.step)

        val_loss = None if stopped else self.evaluate()
        tasks = {} if stopped else self.eval_tasks()
        self._close_loaders()
        step_dir = self.output_dir / "checkpoints" / f"step-{self.step}"
        if not stopped and not (step_dir / "model.json").is_file():
            self._save_now()
        self.checkpointer.wait()
        summary = {
            "first_loss": first[1] if first else None,
            "final_loss": recent[-1][1] if recent else None,
            # the mean of the last min(logging_steps, steps run) good steps, and which steps those were
            "final_loss_avg": sum(l for _, l in recent) / len(recent) if recent else None,
            "final_loss_steps": [recent[0][0], recent[-1][0]] if recent else None,
            "val_loss": val_loss,
            "steps": self.step,
            "checkpoint": str(step_dir),
            "stopped_by_signal": signals.describe() if stopped else None,  # e.g. "SIGTERM"
            "skipped_steps": self.health.skipped_total,
            "eval": tasks,  # eval/<task>/<metric> of eval.tasks at the end
        }
        if val_loss is not None or tasks:
            logger.log(self.step, {"step": self.step, "val_loss": val_loss, **tasks})
        logger.close()
        if self.is_main and cfg.metrics.console and first is not None:
            val = f", validation loss {val_loss:.3f}" if val_loss is not None else ""
            (lo, hi) = summary["final_loss_steps"]
            last = f"step {hi}" if lo == hi else f"mean of steps {lo}-{hi}"
            self.console.print(f"done: {plural(self.step, 'step')}, loss {first[1]:.3f} (step {first[0]}) -> "
                               f"{summary['final_loss_avg']:.3f} ({last}){val}; model saved to {step_dir}")
            self.console.print(f"see the run: ember report {self.output_dir}", markup=False, highlight=False)
        return summary

    def _close_loaders(self) -> None:
        for loader in (self.train_loader, self.val_loader):
            if loader is not None:
                loader.close()  # stop the prefetch threads before the process moves on

    def _save_now(self) -> None:
        self.checkpointer.save(self.step, self.train_state(), blocking=True)

    def _metrics_record(self, loss: float, lr: float, grad_norm: float, window: dict, tokens_per_step: int) -> dict:
        """The metrics.jsonl record of a logging step (window: time, steps, loss and data wait since the last)."""
        achieved = tokens_per_step * window["steps"] / window["time"] / self.world_size * self.flops_per_token
        peak = raise_measured_peak(self.peak, achieved)
        if peak != self.peak:
            self._say(f"note: this run beat the measured CPU matmul peak; MFU is now against "
                      f"{peak.value_flops / 1e12:.3f} TFLOP/s, the best rate seen ({peak.source})")
            self.peak = peak
        record = throughput_record(
            step=self.step, loss=loss, lr=lr, grad_norm=grad_norm, window_time=window["time"],
            window_steps=window["steps"], window_loss=window["loss"], window_data_wait=window["data"],
            tokens_per_step=tokens_per_step, world_size=self.world_size, flops_per_token=self.flops_per_token,
            peak_flops=self.peak.value_flops, device=self.device)
        if self.n_experts:  # MoE: router losses, and the load of every expert of every layer over the window
            record.update(moe_lib.collect_moe_metrics(self.model_parts, self.model_args.n_layers, self.n_experts,
                                                      self.forward_backward.all_sum, self.device))
        if self.forward_backward.dpo is not None:  # reward margin, accuracy, rewards over the window's pairs
            record.update(self.forward_backward.dpo.pop_metrics())
        for source, count in (self.train_loader.mixture_counts() or {}).items():
            record[f"mix/{source}"] = count  # samples drawn from each mixture source so far
        return record

    def _model_label(self) -> str:
        """The model that was built: with model.init_from the source's architecture, whatever flavor the recipe names."""
        model = self.cfg.model
        return f"{model.family} (from {model.init_from})" if model.init_from else f"{model.family} {model.flavor}"

    def _built_model(self) -> dict[str, Any]:
        """run.json's record of the model that was built (model.json's fields), and where its architecture came from."""
        return {**meta_for(self.cfg.model.family, self.model_choice.flavor, self.model_args),
                "init_from": self.cfg.model.init_from, "architecture_from": self.model_choice.source}

    def _compute_description(self) -> str:
        """What the steps compute in: the dtype, or FP8's recipe, emulation and converted linears."""
        if self.fp8_recipe:
            return fp8_lib.describe_fp8(self.model_parts, self.fp8_recipe, self.cfg.fp8.emulate, self.compute_dtype)
        return str(self.compute_dtype).replace("torch.", "")

    def _print_header(self) -> None:
        if not (self.is_main and self.cfg.metrics.console):
            return
        cfg, args = self.cfg, self.model_args
        tok = f"tokenizer vocab {self.tokenizer.vocab_size}" if self.tokenizer else "synthetic tokens"
        peak = f"{self.peak.value_flops / 1e12:.3f} TFLOP/s ({self.peak.source})" if self.peak.value_flops else "unknown"
        self.console.print(
            f"[bold]ember train[/bold] {self._model_label()}: {self.num_params:,} params, {plural(args.n_layers, 'layer')}, "
            f"dim {args.dim}, {tok} | {self.device.type} {self._compute_description()} | "
            f"global batch {cfg.global_batch_size} x seq {cfg.seq_len} "
            f"(micro {cfg.micro_batch_size} x accum {self.grad_accum}) | mesh {self.shape.describe()} | "
            f"peak {peak} | output {self.output_dir}"
        )
        if self.allocator_note:
            self.console.print(f"cpu: {self.allocator_note}", markup=False, highlight=False)
        if cfg.model.init_from:
            source = self.model_choice.source
            self.console.print(f"model: initialised from {cfg.model.init_from} (architecture from {source})",
                               markup=False, highlight=False)
        if cfg.lora.rank:
            trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)  # this rank's shards
            self.console.print(f"lora: rank {cfg.lora.rank}, alpha {cfg.lora.alpha:g}, targets {cfg.lora.targets}; "
                               f"{trainable:,} trainable parameters on this rank, the base frozen", markup=False, highlight=False)
        self.console.print(f"data: {self.train_loader.describe()}", markup=False, highlight=False)
        if self.val_note:
            self.console.print(self.val_note, markup=False, highlight=False)
        if self.peak.value_flops is None:
            self.console.print(f"[yellow]MFU not reported: {self.peak.source}[/yellow]")


def run(cfg: JobConfig) -> dict:
    """Build a Trainer and train; the CLI's `ember train` and the tests call this."""
    return Trainer(cfg).train()
