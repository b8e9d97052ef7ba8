"""MFU arithmetic, memory readings, and the metric sinks: console (rich), metrics.jsonl, TensorBoard."""

from __future__ import annotations

import json
import math
import resource
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from torch import nn

from ember.config_schema import MetricsConfig
from ember.hardware.device import cpu_runs_bf16_natively

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

    from ember.data.tokenizer import AnyTokenizer
    from ember.hardware.peaks import PeakFlops
    from ember.train.run import RunSpec

GIB = 2**30  # memory_gb is in GiB (the console says so): the unit of the vendors' "80GB" of HBM (ember.hardware.peaks)


def plural(count: int, noun: str) -> str:
    """`1 layer`, `2 layers`: a count as the console says it."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def mfu(tokens_per_s_per_device: float, flops_per_token: float, peak_flops: Optional[float]) -> Optional[float]:
    """Model FLOPs utilisation, a fraction in [0, 1]: achieved model FLOP/s per device / peak FLOP/s.

    FLOPs per token (PaLM, Chowdhery et al. 2022, appendix B):
        6 * N + 12 * n_layers * n_heads * head_dim * seq_len
    N is the non-embedding parameter count: 2 FLOPs per parameter per token forward (multiply, add),
    4 backward (gradients of activations and of weights). The second term is attention's QK^T and
    AV, which no parameter counts: 2 matmuls x 2 FLOPs x seq_len x (n_heads * head_dim) per layer
    forward, x3 with the backward. It is the *model's* FLOPs, so activation recomputation does not
    raise MFU. ember.models computes flops_per_token; this only divides. None when the peak is unknown.
    """
    if peak_flops is None or peak_flops <= 0:
        return None
    return tokens_per_s_per_device * flops_per_token / peak_flops


def model_label(spec: RunSpec) -> str:
    """The model that was built: with model.init_from the source's architecture, whatever flavor the recipe names."""
    model = spec.cfg.model
    return f"{model.family} (from {model.init_from})" if model.init_from else f"{model.family} {model.flavor}"


def compute_description(spec: RunSpec, model_parts: list[nn.Module]) -> str:
    """What the steps compute in: the dtype, or FP8's recipe, emulation and converted linears."""
    if spec.parallel.fp8_recipe:
        from ember.parallel.fp8 import describe_fp8

        return describe_fp8(model_parts, spec.parallel.fp8_recipe, spec.parallel.fp8_emulate, spec.compute_dtype)
    return str(spec.compute_dtype).replace("torch.", "")


def run_record(spec: RunSpec, model_parts: list[nn.Module], num_params: int, peak: PeakFlops) -> dict[str, Any]:
    """run.json's facts about the run: the device, mesh and compute, the model that was built (model.json's
    fields) with where its architecture came from, every decision ember.train.run.resolve made, and the peak MFU is
    divided by (`mfu_peak`; a record's `mfu_peak_tflops` says when a run raised it)."""
    from ember.model_io.model_meta import meta_for

    model = {**meta_for(spec.family, spec.flavor, spec.args), "init_from": spec.cfg.model.init_from,
             "architecture_from": spec.architecture_from}
    return {"device": spec.device, "mesh": spec.shape.describe(), "world_size": spec.world_size, "params": num_params,
            "compute": compute_description(spec, model_parts), "model": model, "decisions": spec.describe(),
            "mfu_peak": peak.describe()}


def _wide_heads(args: Any) -> str:
    """The heads' shape where model.head_dim sets it apart from dim / n_heads (else nothing to say)."""
    return f" ({args.n_heads} heads of {args.head_dim})" if getattr(args, "head_dim_override", None) else ""


def print_header(console: Console, spec: RunSpec, model: nn.Module, num_params: int,
                 tokenizer: Optional[AnyTokenizer], peak: PeakFlops, data: str, notes: list[Optional[str]],
                 num_active: Optional[int] = None) -> None:
    """The run's header: the model (with an MoE's `num_active` parameters per token), device and compute, batch and
    mesh, the MFU peak, then one line each for model.init_from, LoRA, the data and the given `notes` (those not
    None)."""
    cfg, args = spec.cfg, spec.args
    parts = list(model) if isinstance(model, nn.ModuleList) else [model]
    tok = f"tokenizer vocab {tokenizer.vocab_size:,}" if tokenizer else "synthetic tokens"
    peak_text = f"{peak.value_flops / 1e12:.3f} TFLOP/s ({peak.source})" if peak.value_flops else "unknown"
    if peak.provisional:
        peak_text += "; MFU marked ? until a quiet measurement settles it"
    console.print(
        f"[bold]ember train[/bold] {model_label(spec)}: {num_params:,} params"
        f"{f' ({num_active:,} active)' if num_active is not None and num_active != num_params else ''}, "
        f"{plural(args.n_layers, 'layer')}, "
        f"dim {args.dim}{_wide_heads(args)}, {tok} | {spec.device.type} {compute_description(spec, parts)} | "
        f"global batch {cfg.global_batch_size} x seq {cfg.seq_len} "
        f"(micro {cfg.micro_batch_size} x accum {spec.grad_accum}) | mesh {spec.shape.describe()} | "
        f"MFU peak {peak_text} | output {Path(cfg.output_dir)}"
    )
    lines = notes[:1]
    if cfg.model.init_from:
        lines.append(f"model: initialised from {cfg.model.init_from} (architecture from {spec.architecture_from})")
    if cfg.lora.rank:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)  # this rank's shards
        lines.append(f"lora: rank {cfg.lora.rank}, alpha {cfg.lora.alpha:g}, targets {cfg.lora.targets}; "
                     f"{trainable:,} trainable parameters on this rank, the base frozen")
    lines += [spec.precision_note, f"data: {data}", *notes[1:]]
    if tokenizer is not None:
        from ember.data.tokenizer import embedded_bpe_note  # here: tokenizers' import only where there is one

        lines.append(embedded_bpe_note(cfg.data, tokenizer, args.vocab_size))
    if spec.device.type == "cpu" and spec.compute_dtype == torch.bfloat16 and not cpu_runs_bf16_natively():
        lines.append("note: precision=bf16 on a CPU without bf16 matmul instructions (AVX512-BF16, AMX): torch "
                     "emulates them, many times slower than fp32; precision=fp32 (or auto) trains faster here")
    if cfg.schedule.warmup_steps >= cfg.max_steps:
        lines.append(f"note: schedule.warmup_steps={cfg.schedule.warmup_steps} >= max_steps={cfg.max_steps}: the "
                     f"learning rate is still warming up at the last step and never reaches optim.lr={cfg.optim.lr:g}")
    for line in lines:
        if line:
            console.print(line, markup=False, highlight=False)
    if peak.value_flops is None:
        console.print(f"[yellow]MFU not reported: {peak.source}[/yellow]")


def raise_peak_if_beaten(peak: PeakFlops, spec: RunSpec, window: dict[str, float],
                         say: Callable[[str], None]) -> PeakFlops:
    """The MFU peak after a logging window (time and steps): raised, and said, where the run beat a measured
    CPU matmul peak (ember.hardware.peaks.raise_measured_peak says why)."""
    from ember.hardware.peaks import raise_measured_peak

    achieved = spec.tokens_per_step * window["steps"] / window["time"] / spec.world_size * spec.flops_per_token
    if spec.cfg.task == "grpo":  # its tokens a step are not known ahead (ember/finetune/grpo.py counts them)
        return peak
    raised = raise_measured_peak(peak, achieved)
    if raised.value_flops != peak.value_flops and raised.run_rate:
        say(f"note: this run beat the measured CPU matmul peak{' (measured again now)' if peak.provisional else ''}; "
            f"MFU is now against {raised.value_flops / 1e12:.3f} TFLOP/s, this run's own rate, and marked ? "
            f"({raised.source})")
    elif raised.value_flops != peak.value_flops:
        say(f"note: this run beat a provisional CPU matmul peak, measured again now: MFU is against "
            f"{raised.value_flops / 1e12:.3f} TFLOP/s ({raised.source})")
    return raised


def progress_bar(console: Console, enabled: bool) -> Progress:
    """The training progress bar: steps done of max_steps, the latest loss, elapsed time and ETA."""
    return Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(), TextColumn("eta"),
                    TimeRemainingColumn(), console=console,
                    disable=not enabled, transient=False)


def throughput_record(*, step: int, loss: float, lr: float, grad_norm: float, window_time: float, window_steps: int,
                      window_loss: float, window_data_wait: float, tokens_per_step: int, world_size: int,
                      flops_per_token: float, peak: PeakFlops, device: torch.device,
                      tokens_seen: Optional[int] = None) -> dict[str, Any]:
    """The metrics.jsonl record of a logging step: the `window_*` sums cover the good steps since the last
    record (their wall time, count, summed loss, and time spent waiting for data). `mfu_peak_tflops` is what
    `mfu` divides by; `mfu_provisional` marks an MFU against a provisional CPU peak or against this run's own
    rate (the console prints it with a ?)."""
    tokens_per_s = tokens_per_step * window_steps / window_time
    per_device = tokens_per_s / world_size
    return {
        "step": step,
        "loss": loss,
        "loss_avg": window_loss / window_steps,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": per_device,
        "step_time_s": window_time / window_steps,
        "tflops_per_device": per_device * flops_per_token / 1e12,
        "mfu": mfu(per_device, flops_per_token, peak.value_flops),
        "mfu_peak_tflops": None if peak.value_flops is None else peak.value_flops / 1e12,
        "mfu_provisional": peak.provisional or peak.run_rate,
        "memory_gb": peak_memory_gb(device),
        "tokens_seen": step * tokens_per_step if tokens_seen is None else tokens_seen,
        "data_wait_frac": window_data_wait / window_time,  # share of step time spent waiting for data
    }


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory in GiB: on CUDA what torch's allocator handed out; on CPU the process's peak RSS.

    The CPU figure is the whole process's high-water mark since it started (ru_maxrss cannot be
    reset), data loading included. Other device types: NaN (written to metrics.jsonl as null).
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    if device.type == "cpu":
        max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        rss_bytes = max_rss if sys.platform == "darwin" else max_rss * 1024  # bytes on macOS, KiB on Linux
        return rss_bytes / GIB
    return math.nan


def _fmt(value: Any, spec: str, scale: float = 1.0, suffix: str = "") -> Optional[str]:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return None
    return f"{value * scale:{spec}}{suffix}"


# The console line: (label, key, format, scale, suffix). Keys missing from a record are left out.
_CONSOLE_FIELDS = [
    ("loss", "loss", ".4f", 1, ""),
    ("lr", "lr", ".2e", 1, ""),
    ("gnorm", "grad_norm", ".3f", 1, ""),
    ("tok/s", "tokens_per_s", ",.0f", 1, ""),
    ("tok/s/dev", "tokens_per_s_per_device", ",.0f", 1, ""),
    ("time", "step_time_s", ".3f", 1, "s"),
    ("TFLOP/s/dev", "tflops_per_device", ".3g", 1, ""),  # 3 significant digits: 0.0213 on a CPU, 412 on a GPU
    ("MFU", "mfu", ".1f", 100, "%"),
    ("mem", "memory_gb", ".2f", 1, "GiB"),
    ("reward", "grpo/reward", ".3f", 1, ""),  # task=grpo (ember/finetune/grpo.py)
    ("len", "grpo/completion_length", ".1f", 1, ""),
    ("val loss", "val_loss", ".4f", 1, ""),
]


def format_line(step: int, values: dict[str, Any]) -> str:
    """One compact console line, e.g. `step    10  loss 7.1234  lr 3.00e-04  ...  MFU 12.3%  mem 1.20GiB`."""
    parts = [f"step {step:>6}"]
    for label, key, spec, scale, suffix in _CONSOLE_FIELDS:
        text = _fmt(values.get(key), spec, scale, suffix)
        if text is not None and key == "mfu" and values.get("mfu_provisional"):
            text += "?"  # against a provisional peak or this run's own rate (the header or a note says which)
        if text is not None:
            parts.append(f"{label} {text}")
    if "replica_groups" in values:  # a step that ran without some replica groups (ember/train/fault_tolerance.py)
        parts.append(f"ran on replica groups {values['replica_groups']} ({values['replica_groups_missing']} "
                     f"missing): {values['tokens']:,} tokens")
    # eval.tasks' results (eval/<task>/<metric>), as the records name them
    parts += [f"{key} {value}" if isinstance(value, int) else f"{key} {value:.4f}"
              for key, value in values.items() if key.startswith("eval/") and isinstance(value, (int, float))]
    return "  ".join(parts)


def _json_value(value: Any) -> Any:
    """JSON has no NaN or Infinity: write them as null so every line parses with any JSON reader."""
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


_warned_no_tensorboard = False


class MetricsLogger:
    """Writes each logged step to the enabled sinks: console line, OUTPUT_DIR/metrics.jsonl, OUTPUT_DIR/tb.

    Non-zero ranks build it with enabled=False, which makes every method a no-op (no files either).
    Pass the Console a rich Progress bar draws on, so metric lines print above the bar, not through it.
    """

    def __init__(self, output_dir: Path, cfg: MetricsConfig, enabled: bool = True, console: Optional[Console] = None,
                 start_step: int = 0, run_info: Optional[dict[str, Any]] = None):
        """start_step: the step the run starts after (a resumed run's checkpoint step). Records of later steps,
        logged by a run that crashed after its last checkpoint, are dropped: those steps are trained again,
        so the file stays one series of one run.
        run_info: facts of the run that no record holds (device, mesh, world_size, params), for OUTPUT_DIR/run.json
        (`ember report` reads it) and the trackers, which start here (ember.metrics.trackers: metrics.wandb,
        metrics.mlflow)."""
        self.enabled = enabled
        self.print_to_console = enabled and cfg.console
        self.console = console if console is not None else Console()
        self._jsonl = None
        self._tb = None
        self._trackers = None
        if not enabled:
            return
        output_dir = Path(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        if run_info is not None:
            run_info = _run_info(run_info)
            (output_dir / "run.json").write_text(json.dumps(run_info, indent=2) + "\n", encoding="utf-8")
        if getattr(cfg, "wandb", False) or getattr(cfg, "mlflow", False):
            from ember.metrics.trackers import Trackers  # wandb and mlflow take seconds to import: only when asked for

            self._trackers = Trackers(cfg, output_dir, run_info)
        if cfg.jsonl:
            path = output_dir / "metrics.jsonl"
            _drop_records_after(path, start_step)
            self._jsonl = open(path, "a", encoding="utf-8")  # a resumed run continues the same file
        if cfg.tensorboard:
            self._tb = _summary_writer(output_dir / "tb", purge_step=start_step + 1)

    def log(self, step: int, values: dict[str, Any], console: bool = True) -> None:
        """Record `values` for optimizer step `step`; JSONL keys are exactly those given (plus `step`). console=False:
        the record is not printed (it is still written everywhere else)."""
        if not self.enabled:
            return
        if self._jsonl is not None:
            record = values if "step" in values else {"step": step, **values}
            self._jsonl.write(json.dumps({k: _json_value(v) for k, v in record.items()}) + "\n")
            self._jsonl.flush()  # a crash or a kill must not lose the steps already logged
        if self._tb is not None:
            for key, value in values.items():
                value = _json_value(value)
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):  # None skipped
                    self._tb.add_scalar(key, value, step)
        if self._trackers is not None:
            self._trackers.log(step, values)
        if self.print_to_console and console:
            # soft_wrap: one line even when it is wider than the console (a pipe counts as 80 columns).
            self.console.print(format_line(step, values), markup=False, highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()  # flushes the events written since the last periodic flush
            self._tb = None
        if self._trackers is not None:
            self._trackers.close()
            self._trackers = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _run_info(info: dict[str, Any]) -> dict[str, Any]:
    """run.json's content: a torch.device becomes its type and the hardware's name (GPU model, CPU model)."""
    info = dict(info)
    device = info.get("device")
    if isinstance(device, torch.device):
        from ember.hardware.cpu_rates import cpu_model

        info["device"] = device.type
        info["device_name"] = torch.cuda.get_device_name(device) if device.type == "cuda" else (
            cpu_model() if device.type == "cpu" else device.type)
    return info


def _drop_records_after(path: Path, step: int) -> None:
    """Keep only the records of steps <= `step` (all of them when the file is new)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record_step = json.loads(line).get("step", 0)
        except (ValueError, AttributeError):
            continue  # a line cut by a crash mid-write
        if isinstance(record_step, int) and record_step <= step:
            kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    tmp.replace(path)


def _summary_writer(log_dir: Path, purge_step: Optional[int] = None) -> Optional[SummaryWriter]:
    """A TensorBoard SummaryWriter, or None (warned once per process) when tensorboard is missing.

    Imported here, not at the top: importing tensorboard takes ~0.6 s on top of torch, which a run with
    metrics.tensorboard=false, or `ember --help`, should not pay.
    """
    global _warned_no_tensorboard
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        if not _warned_no_tensorboard:
            _warned_no_tensorboard = True
            warnings.warn(
                "tensorboard is not installed, so no TensorBoard events are written "
                "(pip install tensorboard, or set metrics.tensorboard=false)",
                stacklevel=3,
            )
        return None
    # purge_step: TensorBoard hides the events of steps >= it written before (a crashed run's last steps).
    return SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)
