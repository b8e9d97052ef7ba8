"""Traces of chosen training steps (`profile.enabled=true profile.step=S profile.steps=K`) and their summary.

torch.profiler records steps S..S+K-1 of every rank into OUTPUT_DIR/profile/rank{r}.step{S}-{E}.pt.trace.json:
Chrome trace JSON, which Perfetto (ui.perfetto.dev), chrome://tracing and TensorBoard's profiler plugin (a
`*.pt.trace.json` under the log directory) open. The trainer marks its phases with record_function ranges:
`ember/step N` around each step, and inside it `ember/data_wait`, `ember/forward`, `ember/backward`,
`ember/optimizer`, `ember/checkpoint`. On CUDA a memory snapshot of the same steps goes beside the trace
(rank{r}.memory.pickle, for pytorch.org/memory_viz).

At the end of the traced steps rank 0 prints a summary: the top ops by self time, the share of the time in
matrix products, attention, communication and the other (mostly elementwise) ops, and the exposed
communication: the time during which a collective ran and no computation did (on CUDA, over kernels; on
CPU, over the ops of the host threads). The profiler only observes: the run's numbers do not change.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import torch
from torch.profiler import ProfilerActivity, profile, record_function

if TYPE_CHECKING:
    from torch.autograd.profiler_util import FunctionEvent

# Op names by category (self time is counted once: a composite like aten::linear keeps only its own time).
MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm", "aten::_scaled_mm")
ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention", "flex_attention", "cudnn_attention")
COMMUNICATION = ("nccl", "gloo", "c10d::", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
                 "all_to_all", "alltoall", "broadcast", "record_param_comms")


def category(name: str) -> str:
    """matmul | attention | communication | other: which share of the time an op's self time counts in."""
    lowered = name.lower()
    if any(key in lowered for key in COMMUNICATION):
        return "communication"
    if name in MATMUL or "gemm" in lowered or lowered.startswith(("sm90_xmma", "ampere_", "cutlass")):
        return "matmul"
    if any(key in lowered for key in ATTENTION):
        return "attention"
    return "other"


def phase(name: str) -> contextlib.AbstractContextManager:
    """A named range in the trace (`ember/<name>`); costs next to nothing when no profiler runs."""
    return record_function(f"ember/{name}")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def exposed_time(communication: list[tuple[float, float]], compute: list[tuple[float, float]]) -> float:
    """The length of the time covered by `communication` intervals and by no `compute` interval."""
    exposed = 0.0
    busy = _union(compute)
    for start, end in _union(communication):
        covered = sum(max(0.0, min(end, b) - max(start, a)) for a, b in busy if a < end and b > start)
        exposed += (end - start) - covered
    return exposed


@dataclass
class Summary:
    total_s: float  # self time of every op counted
    shares: dict[str, float]  # category -> fraction of total_s
    top: list[tuple[str, float]]  # (op, self seconds), largest first
    communication_s: float
    exposed_communication_s: float
    steps: tuple[int, int]

    def lines(self) -> list[str]:
        first, last = self.steps
        out = [f"profile of steps {first}-{last}: " + ", ".join(f"{k} {v:.0%}" for k, v in self.shares.items())
               + f"; communication {self.communication_s * 1e3:.1f} ms, "
               f"exposed {self.exposed_communication_s * 1e3:.1f} ms"]
        out += [f"  {seconds * 1e3:9.1f} ms  {name}" for name, seconds in self.top]
        return out


def summarize(prof: profile, steps: tuple[int, int], cuda: bool, top: int = 10) -> Summary:
    """The summary of a finished torch.profiler.profile (see the module docstring)."""
    self_time = "self_device_time_total" if cuda else "self_cpu_time_total"
    totals: dict[str, float] = {}
    for event in prof.key_averages():
        seconds = getattr(event, self_time, 0.0) / 1e6
        if seconds > 0 and not event.key.startswith(("ember/", "ProfilerStep")):
            totals[event.key] = totals.get(event.key, 0.0) + seconds
    total = sum(totals.values()) or 1.0
    shares = dict.fromkeys(("matmul", "attention", "communication", "other"), 0.0)
    for name, seconds in totals.items():
        shares[category(name)] += seconds / total
    comm, compute = [], []
    for event in prof.events():
        on_device = str(getattr(event, "device_type", "")).endswith("CUDA")
        if cuda != on_device or event.name.startswith(("ember/", "ProfilerStep")):
            continue
        if not cuda and _inside_communication(event):
            continue  # the copies a collective makes are its own time, not computation beside it
        span = (event.time_range.start / 1e6, event.time_range.end / 1e6)
        (comm if category(event.name) == "communication" else compute).append(span)
    return Summary(total, shares, sorted(totals.items(), key=lambda kv: -kv[1])[:top],
                   sum(b - a for a, b in _union(comm)), exposed_time(comm, compute), steps)


def _inside_communication(event: FunctionEvent) -> bool:
    parent = getattr(event, "cpu_parent", None)
    while parent is not None:
        if category(parent.name) == "communication":
            return True
        parent = getattr(parent, "cpu_parent", None)
    return False


KINETO_NOTICES = ("USDT:", "STAGE:")  # kineto's own start/stop markers, written at any KINETO_LOG_LEVEL


@contextlib.contextmanager
def without_kineto_notices() -> Iterator[None]:
    """Hold what C code writes to fd 2 while the profiler starts or stops, and pass it on without kineto's
    `USDT: ... profiler_start` notices: they go straight to the file descriptor, past Python's sys.stderr,
    and no setting turns them off. Anything else written meanwhile (a real warning) still reaches stderr."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().decode("utf-8", "replace").splitlines(keepends=True)
                    if not line.startswith(KINETO_NOTICES)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


class StepProfiler:
    """Starts torch.profiler as step `first` begins and stops it as step `first + steps` begins (1-based, the
    step numbers the run logs), so a traced step includes its data wait, logging, evaluation and checkpoint;
    writes the trace (and on CUDA the memory snapshot) and hands the summary to `say`."""

    def __init__(self, enabled: bool, first: int, steps: int, output_dir: Path, rank: int, device: torch.device,
                 say: Callable[[str], None]):
        self.enabled, self.first, self.last = enabled, first, first + steps - 1
        self.folder, self.rank, self.device, self.say = Path(output_dir) / "profile", rank, device, say
        self._prof: Optional[profile] = None

    def plan(self, start_step: int, max_steps: int) -> None:
        """Say before the first step what will not be traced as asked: steps that a resumed run ran before, or
        that max_steps cuts off (config refuses a first step past max_steps; a resume can still cut the window)."""
        if not self.enabled or start_step >= max_steps:
            return
        first, last = max(self.first, start_step + 1), min(self.last, max_steps)
        cuts = [f"this run resumes after step {start_step}"] if first != self.first else []
        cuts += [f"max_steps={max_steps} ends the run"] if last != self.last else []
        if not cuts:
            return
        asked = (f"steps {self.first}-{self.last} "
                 f"(profile.step={self.first}, profile.steps={self.last - self.first + 1})")
        if first > last:
            self.say(f"profile: nothing is traced: {asked} asked, but {' and '.join(cuts)}; choose profile.step in "
                     f"{start_step + 1}-{max_steps}")
            self.enabled = False
        else:
            self.say(f"profile: tracing steps {first}-{last} only: {asked} asked, but {' and '.join(cuts)}")
            self.first, self.last = first, last

    def start_step(self, step: int) -> None:
        """Step `step` is about to begin (before its data wait)."""
        if self._prof is not None and step > self.last:
            self.finish(step - 1)
        if self.enabled and step == self.first and self._prof is None:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            if self.device.type == "cuda":
                torch.cuda.memory._record_memory_history(max_entries=100_000)
            self._prof = profile(activities=activities, record_shapes=False, with_stack=False)
            with without_kineto_notices():
                self._prof.__enter__()

    def step_range(self, step: int) -> contextlib.AbstractContextManager:
        """`ember/step N` in the trace around the step's data wait and training step, while tracing."""
        return record_function(f"ember/step {step}") if self._prof is not None else contextlib.nullcontext()

    def finish(self, last_step: int) -> None:
        """Stop, write the files, print the summary (also when the run ends inside the traced steps)."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        with without_kineto_notices():
            prof.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"rank{self.rank}.step{self.first}-{last_step}.pt.trace.json"
        prof.export_chrome_trace(str(trace))
        if self.device.type == "cuda":
            torch.cuda.memory._dump_snapshot(str(self.folder / f"rank{self.rank}.memory.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        summary = summarize(prof, (self.first, last_step), self.device.type == "cuda")
        for line in summary.lines():
            self.say(line)
        self.say(f"profile: traces in {self.folder} (open in ui.perfetto.dev or TensorBoard's profiler plugin)")
