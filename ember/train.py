"""The Trainer: build everything in a fixed order, then run the loop. Read it top to bottom.

Build order (ARCHITECTURE.md): model on meta -> parallelize -> to_empty -> init_weights -> optimizer.
Loss and gradient-accumulation math live in `train_step` and nowhere else.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from ember import config as config_lib
from ember.config import ConfigError, JobConfig
from ember.data.loader import build_loader
from ember.data.tokenizer import build_tokenizer
from ember.hardware import peak_flops
from ember.load import save_ember_checkpoint
from ember.metrics import MetricsLogger, mfu, peak_memory_gb
from ember.models import MODELS, build_model_args
from ember.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_

IGNORE_INDEX = -100  # label value that takes a token out of the loss (prompt tokens in SFT, padding)


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


class Trainer:
    """Owns the model, optimizer, data and metrics of one run (a single process until the parallelism issue)."""

    def __init__(self, cfg: JobConfig, console: Optional[Console] = None):
        self.cfg = cfg
        # soft_wrap: a metrics line stays one line in logs and pipes, whatever the terminal width.
        self.console = console or Console(soft_wrap=True)
        self.rank, self.world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        if self.world_size > 1:
            raise ConfigError(
                "multi-process training (torchrun) needs the ici_mesh/dcn_mesh sections, which are not in this "
                "version; run a single process"
            )
        self.dp_rank, self.dp_world = 0, 1
        self.is_main = self.rank == 0
        self.device = pick_device(cfg.device)
        self.compute_dtype = pick_compute_dtype(cfg.precision, self.device)
        self.output_dir = Path(cfg.output_dir)
        self.grad_accum = config_lib.grad_accum_steps(cfg, self.dp_world)
        torch.manual_seed(cfg.seed)

        # Tokenizer first: the model's vocabulary must cover it, and that is a config error, not a crash.
        spec = MODELS[cfg.model.family]
        self.model_args = build_model_args(cfg.model.family, cfg.model.flavor, config_lib.model_overrides(cfg.model))
        self.tokenizer = None
        if cfg.data.dataset != "synthetic":
            self.tokenizer = build_tokenizer(cfg.data, self.model_args.vocab_size)

        # Model: meta -> parallelize -> to_empty -> init_weights (so 405B never materialises on one host).
        with torch.device("meta"):
            model = spec.model_cls(self.model_args)
        model = spec.parallelize(model, mesh=None, compile=cfg.compile)
        model.to_empty(device=self.device)
        with torch.no_grad():
            model.init_weights()
        self.model = model
        self.spec = spec
        self.flops_per_token = spec.flops_per_token(self.model_args, cfg.seq_len)

        self.optimizer = build_optimizer(model, cfg.optim, self.device.type)
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
        if cfg.data.dataset in ("embedded", "synthetic"):
            self.val_loader = build_loader(cfg.data, self.tokenizer, split="val", **loader_kwargs)

        peak = peak_flops(self.device, self.compute_dtype, cfg.metrics.peak_tflops)
        self.peak_flops, self.peak_source = peak.value_flops, peak.source
        self.step = 0

    # ---------------------------------------------------------------- one optimizer step
    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def _loss_sum(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            logits = self.model(inputs)  # (B, T, V)
        # fp32 for the softmax over a large vocabulary: bf16 log-sum-exp loses the small probabilities.
        return F.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=IGNORE_INDEX, reduction="sum"
        )

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
        """Forward/backward over the micro-batches of one global batch, clip, step.

        The loss is the mean over every target token of the global batch: each micro-batch contributes
        its *sum* of token losses divided by the global token count, so unequal micro-batches (masked
        labels) weigh correctly and gradient accumulation needs no extra scaling.
        """
        self.model.train()
        n_tokens = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in micro_batches)
        loss_total = torch.zeros((), device=self.device)
        for inputs, labels in micro_batches:
            inputs = inputs.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            loss = self._loss_sum(inputs, labels) / max(n_tokens, 1)
            loss.backward()
            loss_total += loss.detach()
        grad_norm = clip_grad_norm_(self.model.parameters(), self.cfg.optim.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        return float(loss_total), float(grad_norm)

    @torch.no_grad()
    def evaluate(self) -> Optional[float]:
        if self.val_loader is None:
            return None
        self.model.eval()
        loss_sum, n_tokens = 0.0, 0
        self.val_loader.reset()  # the same validation batches every time, so evaluations compare
        val_iter = iter(self.val_loader)
        for _ in range(self.cfg.eval_batches):
            inputs, labels = next(val_iter)
            loss_sum += float(self._loss_sum(inputs.to(self.device), labels.to(self.device)))
            n_tokens += int((labels != IGNORE_INDEX).sum())
        self.model.train()
        return loss_sum / max(n_tokens, 1)

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
        window_time, window_steps, window_loss = 0.0, 0, 0.0
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
        with progress:
            task = progress.add_task("train", total=cfg.max_steps, loss="-")
            while self.step < cfg.max_steps:
                t0 = time.perf_counter()
                micro_batches = next(batches)
                lr = self.optimizer.param_groups[0]["lr"]
                loss, grad_norm = self.train_step(micro_batches)
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                step_time = time.perf_counter() - t0
                self.step += 1
                if not math.isfinite(loss):
                    raise FloatingPointError(
                        f"loss is {loss} at step {self.step}; lower optim.lr or raise schedule.warmup_steps"
                    )
                first_loss = loss if first_loss is None else first_loss
                window_time, window_steps, window_loss = window_time + step_time, window_steps + 1, window_loss + loss
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
                    }
                    logger.log(self.step, record)
                    history.append(record)
                    window_time, window_steps, window_loss = 0.0, 0, 0.0
                # Validation on its own cadence, outside the timed window of the step it follows.
                if cfg.eval_interval and self.step % cfg.eval_interval == 0 and self.step < cfg.max_steps:
                    logger.log(self.step, {"step": self.step, "val_loss": self.evaluate()})

        val_loss = self.evaluate()
        for loader in (self.train_loader, self.val_loader):
            if loader is not None:
                loader.close()  # stop the prefetch threads before the process moves on
        step_dir = self.output_dir / "checkpoints" / f"step-{self.step}"
        if self.is_main:
            save_ember_checkpoint(self.model, cfg.model.family, cfg.model.flavor, self.model_args, step_dir)
        summary = {
            "first_loss": first_loss,
            "final_loss": history[-1]["loss"] if history else None,
            "final_loss_avg": history[-1]["loss_avg"] if history else None,
            "val_loss": val_loss,
            "steps": self.step,
            "checkpoint": str(step_dir),
        }
        if val_loss is not None:
            logger.log(self.step, {"step": self.step, "val_loss": val_loss})
        logger.close()
        if self.is_main and cfg.metrics.console:
            val = f", validation loss {val_loss:.3f}" if val_loss is not None else ""
            self.console.print(
                f"done: {self.step} steps, loss {first_loss:.3f} -> {summary['final_loss_avg']:.3f} "
                f"(mean of the last {cfg.logging_steps} steps){val}; model saved to {step_dir}"
            )
        return summary

    def _print_header(self) -> None:
        if not (self.is_main and self.cfg.metrics.console):
            return
        cfg, args = self.cfg, self.model_args
        n_params = sum(p.numel() for p in self.model.parameters())
        dtype = str(self.compute_dtype).replace("torch.", "")
        tok = f"tokenizer vocab {self.tokenizer.vocab_size}" if self.tokenizer else "synthetic tokens"
        self.console.print(
            f"[bold]ember train[/bold] {cfg.model.family} {cfg.model.flavor}: {n_params:,} params, "
            f"{args.n_layers} layers, dim {args.dim}, {tok} | {self.device.type} {dtype} | "
            f"global batch {cfg.global_batch_size} x seq {cfg.seq_len} "
            f"(micro {cfg.micro_batch_size} x accum {self.grad_accum}) | peak {self._peak_str()} | "
            f"output {self.output_dir}"
        )

    def _peak_str(self) -> str:
        if self.peak_flops is None:
            return "unknown"
        return f"{self.peak_flops / 1e12:.2f} TFLOP/s ({self.peak_source})"


def run(cfg: JobConfig) -> dict:
    """Build a Trainer and train; the CLI's `ember train` and the tests call this."""
    return Trainer(cfg).train()
