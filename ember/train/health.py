"""Run health: non-finite steps are skipped (and too many in a row stop the run), loss spikes are reported
with the data position that produced them, and stop signals (preemption) end the run at a step boundary
with a checkpoint, on every rank at the same step."""

from __future__ import annotations

import math
import os
import signal
import threading
from types import FrameType
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist


class TrainingStopped(RuntimeError):
    """The run stopped itself (e.g. too many non-finite steps); the message says why and what to do."""


def is_finite_step(loss: float, grad_norm: float) -> bool:
    """A step whose loss and gradient norm are finite: the optimizer steps; otherwise the step is skipped."""
    return math.isfinite(loss) and math.isfinite(grad_norm)


class HealthGuard:
    """Counts skipped steps and keeps the running loss mean; its state goes into every checkpoint."""

    def __init__(self, max_skipped_steps: int, loss_spike_factor: float, say: Callable[[str], None]):
        self.max_skipped_steps, self.loss_spike_factor, self.say = max_skipped_steps, loss_spike_factor, say
        self.skipped_in_a_row, self.skipped_total = 0, 0
        self.loss_mean: Optional[float] = None  # running mean for the loss-spike warning

    def state_dict(self) -> dict[str, Any]:
        return {"skipped_in_a_row": self.skipped_in_a_row, "skipped_total": self.skipped_total,
                "loss_mean": self.loss_mean}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped_in_a_row, self.skipped_total = state["skipped_in_a_row"], state["skipped_total"]
        self.loss_mean = state["loss_mean"]

    def skipped(self, step: int, loss: float, grad_norm: float, save: Callable[[], None]) -> dict[str, Any]:
        """A step whose loss or grad norm was not finite changed no weight; too many in a row save the last
        good weights (`save`) and stop the run. Returns the step's metrics record (`ember report` marks it)."""
        self.skipped_in_a_row += 1
        self.skipped_total += 1
        self.say(f"warning: step {step} skipped: loss {loss}, grad norm {grad_norm} "
                 f"({self.skipped_in_a_row} in a row, {self.skipped_total} in all)")
        if self.skipped_in_a_row > self.max_skipped_steps:
            save()
            raise TrainingStopped(
                f"{self.skipped_in_a_row} steps in a row had a non-finite loss or grad norm (max_skipped_steps="
                f"{self.max_skipped_steps}); the last good weights are in checkpoints/step-{step}. "
                "Lower optim.lr, raise schedule.warmup_steps or check the data, then resume"
            )
        return {"step": step, "skipped_step": 1, "skipped_loss": loss, "skipped_grad_norm": grad_norm}

    def good_step(self, step: int, loss: float, data_position: dict[str, Any]) -> Optional[dict[str, Any]]:
        """A good step: update the running mean; a loss over loss_spike_factor x the mean is reported and
        returned as a metrics record (with the data position the batch was read before)."""
        self.skipped_in_a_row = 0
        factor, mean = self.loss_spike_factor, self.loss_mean
        self.loss_mean = loss if mean is None else 0.95 * mean + 0.05 * loss
        if not (factor > 0 and mean is not None and step > 10 and loss > factor * mean):
            return None
        position = {k: v for k, v in data_position.items() if k in ("epoch", "cursor", "draws")}
        self.say(f"warning: loss spike at step {step}: {loss:.4f} is over {factor}x the running mean "
                 f"{mean:.4f}; the batch was read before data position {position}")
        return {"step": step, "loss_spike": loss, "loss_mean": mean, "data_position": position}


class StopSignals:
    """SIGTERM, SIGUSR1 (preemption, SLURM's warning) and SIGINT (Ctrl-C) ask for a checkpoint at the next
    step boundary; a second one exits at once, without saving. Use as a context manager around the loop
    (the previous handlers are restored after)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self, device: torch.device, distributed: bool, say: Callable[[str], None] = print):
        self.device, self.distributed, self.say = device, distributed, say
        self.received: Optional[int] = None  # the signal number; -1 for another rank's
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():  # signals reach only the main thread
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.received is not None:
            os._exit(128 + signum)
        self.received = signum
        if signum == signal.SIGINT:  # a person at the terminal: say at once what happens next
            self.say("interrupted: saving a checkpoint after this step, then exiting (Ctrl-C again: exit now, "
                     "without saving)")

    def describe(self) -> str:
        if self.received is None:
            return "no stop signal"
        return "a stop signal on another rank" if self.received < 0 else signal.Signals(self.received).name

    def agree_to_stop(self) -> bool:
        """Whether any rank got a stop signal: all ranks must save and stop at the same step."""
        flag = torch.tensor(0.0 if self.received is None else 1.0, device=self.device)
        if self.distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0 and self.received is None:
            self.received = -1
        return bool(flag.item() > 0)
