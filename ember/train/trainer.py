"""The Trainer: build everything in a fixed order, then run the loop, on any engine. Read it top to bottom.

Build order (docs/architecture.md): the engine `device` trains on (ember/train/engines.py: the job's ranks and
devices) -> the run's decisions (ember/train/run.py: resolve) -> its mesh -> tokenizer -> model, loss and optimizer
(the engine's `build`) -> LR schedule -> data -> header -> checkpoint resume -> the weights placed. What differs
between torch.distributed and XLA SPMD is the engine's (ember/train/torch_engine.py, ember/xla/engine.py): where the
weights live, the step, the evaluation forward, the reductions and the checkpoint's manager. Everything else is
here: data, health, metrics, evaluation, profiling and checkpoints, for every engine. The loss math lives in
ember/train/step.py, run health and stop signals in ember/train/health.py, the MoE statistics in the engine's collector
(ember/nn/moe_stats.py), the header and metrics records in ember/metrics/run_metrics.py.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Iterator, Optional

import torch
from rich.console import Console

from ember.checkpoint import run_history
from ember.checkpoint.manager import open_checkpoints, rng_state, set_rng_state
from ember.config import JobConfig
from ember.data.loader import build_loader
from ember.data.tokenizer import build_tokenizer
from ember.errors import DataError
from ember.eval.tasks import run_tasks
from ember.finetune import dpo as dpo_lib, grpo as grpo_lib
from ember.metrics.profiling import phase
from ember.metrics.run_metrics import (
    MetricsLogger,
    plural,
    print_header,
    progress_bar,
    raise_peak_if_beaten,
    run_record,
    throughput_record,
)
from ember.nn.decoder import num_params
from ember.storage.cache import local_data
from ember.storage.location import as_path, check_reachable, is_url
from ember.storage.mirror import RunMirror, local_run_dir
from ember.train import engines, fault_tolerance as ft_lib, run as run_lib
from ember.train.health import HealthGuard, StopSignals, TrainingStopped, is_finite_step
from ember.train.optim import build_lr_scheduler, restart_schedule
from ember.train.step import Batch

__all__ = ["Trainer", "TrainingStopped"]


class Trainer:
    """Owns the data, health, metrics, evaluation and checkpoints of one run, on one process or as one rank (or
    host) of many; `self.engine` holds the model and steps it."""

    def __init__(self, cfg: JobConfig, console: Optional[Console] = None):
        if cfg.fault_tolerance.enable:  # each replica group keeps its own run (ember/train/fault_tolerance.py)
            cfg = dataclasses.replace(cfg, output_dir=ft_lib.group_dir(cfg.output_dir,
                                                                       ft_lib.group_from_env(cfg.fault_tolerance)))
        self.cfg = cfg
        # soft_wrap: a metrics line stays one line in logs and pipes, whatever the terminal width.
        self.console = console or Console(soft_wrap=True)
        self.engine = engine = engines.engine_type(cfg.device)(cfg)
        self.rank, self.world_size, self.device = engine.rank, engine.world_size, engine.device
        self.is_main = self.rank == 0
        # Where this host writes the run's files: output_dir, or for a URL its local mirror (ember/storage/mirror.py),
        # pulled from the store here and pushed back after each checkpoint and at the end.
        self.output_dir, self.mirror = local_run_dir(cfg.output_dir), None
        for key, location in (("output_dir", cfg.output_dir), ("resume", cfg.resume)):
            if is_url(location):  # the bucket, the credentials, the endpoint: before any work
                check_reachable(as_path(location), key, must_exist=key == "resume")
        if is_url(cfg.output_dir) and self.is_main:
            self.mirror = RunMirror(as_path(cfg.output_dir), self.output_dir)
            self.mirror.pull()

        # 1. Every decision about the run (ember/train/run.py, which `ember plan` calls too), then the engine's mesh.
        self.spec = spec = run_lib.resolve(cfg, self.world_size, engine.run_device)
        engine.connect(spec)
        self.mesh = engine.mesh
        torch.manual_seed(cfg.seed)
        self.peak = engine.peak()

        # 2. Tokenizer first: the model's vocabulary must cover it, and that is a config error, not a crash.
        # Sources given as URLs are read from their local copies (ember/storage/cache.py); the config keeps the URLs.
        data = local_data(cfg.data)
        self.tokenizer = build_tokenizer(data, spec.args.vocab_size) if cfg.data.dataset != "synthetic" else None

        # 3. Model, loss and optimizer (the engine's), LR schedule.
        engine.build(self.tokenizer)
        self.model_parts, self.model, self.optimizer = engine.model_parts, engine.model, engine.optimizer
        self.num_params = sum(p.numel() for p in engine.whole.parameters())
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.schedule, cfg.max_steps)

        # 4. Data, read by this rank's (host's) data-parallel coordinate.
        rows, dp_rank, dp_world = engine.data_shard()
        loader_kwargs = dict(seq_len=cfg.seq_len, micro_batch_size=rows, dp_rank=dp_rank, dp_world=dp_world,
                             seed=cfg.seed, vocab_size=spec.args.vocab_size)
        # Validation reads every group's share in each group (the same samples, whichever groups are alive).
        groups = ft_lib.replica_groups(cfg)
        val_kwargs = {**loader_kwargs, "dp_rank": dp_rank % (dp_world // groups), "dp_world": dp_world // groups}
        make_loader = {"lm": build_loader, "dpo": functools.partial(dpo_lib.build_pair_loader, dpo_cfg=cfg.dpo),
                       "grpo": functools.partial(grpo_lib.build_prompt_loader, cfg=cfg)}[cfg.task]
        self.train_loader = make_loader(data, self.tokenizer, split="train", **loader_kwargs)
        self.val_loader, val_note = None, None
        try:
            self.val_loader = make_loader(data, self.tokenizer, split="val", **val_kwargs)
        except DataError as err:  # a held-out split too small for one batch: train without validation
            val_note = f"no validation: {err}"
        # The header, once the model and data are known: before what starting over, resuming or a tracker prints.
        if self.is_main and cfg.metrics.console:
            print_header(self.console, spec, self.model, self.num_params, self.tokenizer, self.peak,
                         self.train_loader.describe(), [*engine.notes, val_note],
                         num_active=num_params(engine.whole, active=True))

        # 5. Health, checkpoints: resume restores weights, optimizer, schedule, data position and RNG; then the
        # engine places the weights where they train.
        self.step, self.tokens_missed = 0, 0  # tokens_missed: of steps that ran without some replica groups
        self.health = HealthGuard(cfg.max_skipped_steps, cfg.loss_spike_factor * (cfg.task != "grpo"), self._say)
        self.checkpointer, state = open_checkpoints(spec, self.model_parts, self.model, self.optimizer, self._say,
                                                    manager_type=engine.checkpoint_manager)
        if state is not None:
            self._load_train_state(state)
            restart_schedule(self.lr_scheduler)  # this run's optim.lr and schedule, from the resumed step on
        engine.place(self.checkpointer)
        if self.mirror is not None:
            self.checkpointer.on_commit = self.mirror.push
        # Replica groups: the step the quorum compares, and what a group behind receives from a live peer.
        self.replicas = engine.replicas
        if self.replicas is not None:
            self.replicas.set_step(self.step)
            self.replicas.heal_with(self.checkpointer, self.train_state, self._load_train_state, self._say)

    def _load_train_state(self, state: dict) -> None:
        self.step, self.tokens_missed = int(state["step"]), int(state.get("tokens_missed", 0))
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.train_loader.load_state_dict(state["data"])
        set_rng_state(state["rng"])
        self.health.load_state_dict(state)

    def _say(self, message: str) -> None:
        if self.is_main:
            self.console.print(message, markup=False, highlight=False)

    def train_state(self) -> dict:
        """This rank's part of a checkpoint beside the DCP weights and optimizer state."""
        return {"step": self.step, "tokens_missed": self.tokens_missed, "lr_scheduler": self.lr_scheduler.state_dict(),
                "data": self.train_loader.state_dict(), "rng": rng_state(), **self.health.state_dict(),
                **ft_lib.outer_state(self.engine.diloco_outer, self.world_size)}

    # ---------------------------------------------------------------- one optimizer step
    def global_batches(self) -> Iterator[list[Batch]]:
        """This rank's micro-batches of each global batch, endlessly (grad_accum of them per step)."""
        train_iter = iter(self.train_loader)
        while True:
            yield [next(train_iter) for _ in range(self.spec.grad_accum)]

    def train_step(self, micro_batches: list[Batch]) -> tuple[float, float]:
        """One optimizer step over this rank's micro-batches of one global batch (the engine's), then the LR
        schedule's (not for a step the replica groups did not commit: it is run again)."""
        loss, grad_norm = self.engine.train_step(micro_batches)
        if self.replicas is None or self.replicas.committed:
            self.lr_scheduler.step()
        return loss, grad_norm

    def evaluate(self) -> Optional[float]:
        """The validation loss over eval_batches global batches, whatever the layout (each rank reads its share of
        the same samples, the same ones every time, so evaluations compare); None without a validation split."""
        if self.val_loader is None:
            return None
        self.val_loader.reset()
        val_iter = iter(self.val_loader)
        n = self.cfg.eval_batches * self.spec.grad_accum * ft_lib.replica_groups(self.cfg)
        return self.engine.evaluate([next(val_iter) for _ in range(n)])

    def eval_tasks(self) -> dict[str, float]:
        """eval.tasks as eval/<task>/<metric>, scored by the engine's model (on the torch engine the requests are
        shared out over the data-parallel ranks)."""
        if not self.cfg.eval.tasks:
            return {}
        model, ranks = self.engine.scoring_model()
        results = run_tasks(model, self.tokenizer, self.cfg.eval.tasks, self.cfg.eval.limit, self.cfg.eval.batch_size,
                            ranks)
        model.train()
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
        # config.yaml is this segment's; config_history/ keeps every segment's (ember/checkpoint/run_history.py).
        # The trackers read config.yaml when they start; a start refused before the first step takes the segment back.
        segment = (run_history.SegmentStart(self.output_dir, cfg, self.step, self.checkpointer.resumed_from,
                                            self.checkpointer.changes) if self.is_main else None)
        try:
            run_info = run_record(self.spec, self.model_parts, self.num_params, self.peak)
            logger = MetricsLogger(self.output_dir, cfg.metrics, enabled=self.is_main, console=self.console,
                                   start_step=self.step, run_info=run_info)
        except BaseException:
            if segment is not None:
                segment.undo()
            raise
        recent: collections.deque = collections.deque(maxlen=cfg.logging_steps)  # (step, loss) of the last good steps
        window = {"time": 0.0, "steps": 0, "loss": 0.0, "data": 0.0, "tokens": 0.0}
        first: Optional[tuple[int, float]] = None  # (step, loss) of this run's first good step
        batches = self.global_batches()
        progress = progress_bar(self.console, enabled=self.is_main and cfg.metrics.console)
        stopped, retry = False, None  # retry: the micro-batches of a step the replica groups did not commit
        stepwise = self.replicas is not None and cfg.fault_tolerance.semi_sync == "none"
        # The main rank prints the summary; every rank writes its trace.
        profiler = self.engine.profiler(self.output_dir, self._say)
        profiler.plan(self.step, cfg.max_steps)  # says what max_steps or a resume cuts from the traced steps
        if self.replicas is not None:  # every group in the first quorum (or the timeout): none trains alone at start
            self.replicas.wait_for_groups(self._say)
        with progress, StopSignals(self.device, self.mesh is not None, self._say) as signals:
            task = progress.add_task("train", total=cfg.max_steps, loss="-", completed=self.step)
            while self.step < cfg.max_steps:
                profiler.start_step(self.step + 1)
                with profiler.step_range(self.step + 1):
                    t0 = time.perf_counter()
                    if stepwise:  # the step's quorum; a group behind heals here (its step and data replaced)
                        before = self.step
                        self.replicas.start_step()
                        retry = retry if self.step == before else None
                    with phase("data_wait"):
                        micro_batches = retry or next(batches)
                    data_wait = time.perf_counter() - t0  # time the step waited for the loader
                    lr = self.optimizer.param_groups[0]["lr"]
                    loss, grad_norm = self.train_step(micro_batches)
                    if self.device.type == "cuda":
                        torch.cuda.synchronize()
                    step_time = time.perf_counter() - t0
                if stepwise and not self.replicas.committed:
                    retry = micro_batches  # a group dropped out mid-step: the survivors run it again, same batch
                    self._say(f"step {self.step + 1} did not commit over the replica groups: run again")
                    continue
                retry = None
                self.step += 1
                groups = self.replicas.participants if stepwise else None
                if groups is not None and len(groups) < self.replicas.count:  # the step's real batch, recorded
                    record = ft_lib.degraded_record(self.step, groups, self.replicas.count, self.spec.tokens_per_step)
                    self.tokens_missed += self.spec.tokens_per_step - record["tokens"]
                    logger.log(self.step, record, console=self.step % cfg.logging_steps == 0)  # (printed as often)
                skipped = not is_finite_step(loss, grad_norm)  # train_step changed no weight
                progress.update(task, advance=1, **({} if skipped else {"loss": f"{loss:.3f}"}))
                if skipped:
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
                window["tokens"] += self.spec.tokens_per_step * (len(groups) / self.replicas.count if groups else 1)
                if self.step % cfg.logging_steps == 0 or self.step == cfg.max_steps:
                    record = self._metrics_record(loss, lr, grad_norm, window)
                    logger.log(self.step, record)
                    window = {"time": 0.0, "steps": 0, "loss": 0.0, "data": 0.0, "tokens": 0.0}
                # Validation on its own cadence, outside the timed window of the step it follows.
                if cfg.eval_interval and self.step % cfg.eval_interval == 0 and self.step < cfg.max_steps:
                    evaluated = {"val_loss": self.evaluate(), **self.eval_tasks()}
                    if any(value is not None for value in evaluated.values()):  # no split, no tasks: no line
                        logger.log(self.step, {"step": self.step, **evaluated})
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
        step_dir = self.checkpointer.dir / f"step-{self.step}"
        if not stopped and not (step_dir / "model.json").is_file():
            self._save_now()
        self.checkpointer.wait()
        summary = {
            "first_loss": first[1] if first else None,
            "final_loss": recent[-1][1] if recent else None,
            # the mean of the last min(logging_steps, steps run) good steps, and which steps those were
            "final_loss_avg": sum(loss for _, loss in recent) / len(recent) if recent else None,
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
        if self.replicas is not None:
            self.replicas.close()
        if self.mirror is not None:
            self.mirror.push()
        if self.is_main and cfg.metrics.console and first is not None:
            val = f", validation loss {val_loss:.3f}" if val_loss is not None else ""
            (lo, hi) = summary["final_loss_steps"]
            last = f"step {hi}" if lo == hi else f"mean of steps {lo}-{hi}"
            self.console.print(f"done: {plural(self.step, 'step')}, loss {first[1]:.3f} (step {first[0]}) -> "
                               f"{summary['final_loss_avg']:.3f} ({last}){val}; model saved to {step_dir}")
            self.console.print(f"see the run: ember report {cfg.output_dir}", markup=False, highlight=False)
        return summary

    def _close_loaders(self) -> None:
        for loader in (self.train_loader, self.val_loader):
            if loader is not None:
                loader.close()  # stop the prefetch threads before the process moves on

    def _save_now(self) -> None:
        self.checkpointer.save(self.step, self.train_state(), blocking=True)

    def _metrics_record(self, loss: float, lr: float, grad_norm: float, window: dict) -> dict:
        """The metrics.jsonl record of a logging step (window: time, steps, loss and data wait since the last)."""
        self.peak = raise_peak_if_beaten(self.peak, self.spec, window, self._say)
        record = throughput_record(
            step=self.step, loss=loss, lr=lr, grad_norm=grad_norm, window_time=window["time"],
            window_steps=window["steps"], window_loss=window["loss"], window_data_wait=window["data"],
            # over replica groups: every group's tokens (fewer in a step some missed) on every group's devices
            tokens_per_step=window["tokens"] / window["steps"],
            tokens_seen=self.step * self.spec.tokens_per_step - self.tokens_missed,
            world_size=self.world_size * ft_lib.replica_groups(self.cfg),
            flops_per_token=self.spec.flops_per_token, peak=self.peak, device=self.device)
        n_experts = getattr(self.spec.args, "n_experts", 0)
        if n_experts:  # MoE: router losses, and the load of every expert of every layer over the window
            record.update(self.engine.moe_stats.collect_metrics(self.model_parts, self.spec.args.n_layers, n_experts,
                                                                self.engine.all_sum, self.device))
        record.update(self.engine.window_metrics(record))  # DPO's and GRPO's over the window
        for source, count in (self.train_loader.mixture_counts() or {}).items():
            record[f"mix/{source}"] = count  # samples drawn from each mixture source so far
        self.engine.device_memory(record)
        return record
