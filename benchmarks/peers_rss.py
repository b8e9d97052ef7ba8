"""Peak resident memory of one child process, sampled while it runs: what benchmarks/peers.py reports as a
framework's train RSS and peak RSS. Linux only (/proc, wait4).

The child is started in a process group of its own so that stopping it (a timeout, Ctrl-C, SIGTERM) also stops
what it started, such as torch.compile's workers. The memory reported is the child's own, not its workers': the
workers are a compile-time pool that each framework sizes differently, and training does not run in them.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

POLL_S = 0.02  # how often the child's VmHWM is read: fast enough to see a short-lived peak's high-water mark
KILLED = -9  # the exit code of a child killed by SIGKILL (the timeout, or the kernel's OOM killer)


@dataclass(frozen=True)
class ChildRun:
    """How one child ended and the memory it used.

    peak_kib: its own peak resident memory over its whole life (KiB).
    train_kib: its peak once `steps_done()` first reached the asked count (the training steps' memory, without
    what the framework does after them, such as ember's final evaluation and checkpoint); None if it never did.
    """

    code: int
    peak_kib: int
    output: str
    train_kib: Optional[int]


def vm_hwm_kib(pid: int) -> Optional[int]:
    """A live process's peak resident memory so far (VmHWM in /proc/PID/status, KiB); None where unreadable."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    found = re.search(r"^VmHWM:\s+(\d+) kB", status, re.M)
    return int(found.group(1)) if found else None


def run_child(cmd: list[str], log: Path, timeout_s: float, cwd: Path,
              steps_done: Optional[Callable[[], int]] = None, train_steps: int = 0) -> ChildRun:
    """Runs `cmd` (its output to `log`), sampling its memory until it exits; a child still running after
    `timeout_s` is killed (code KILLED). `steps_done()` is asked, while the child runs, how many training steps
    the files it writes show so far (see ChildRun.train_kib).

    wait4's ru_maxrss also counts the launching process's own peak (Linux carries the memory high-water mark of
    the forked copy across exec), so it is the child's peak only where it exceeds this process's peak at launch;
    otherwise the child's VmHWM, polled while it runs, is reported."""
    launcher_kib = vm_hwm_kib(os.getpid()) or 0
    polled_kib, train_kib = 0, None
    with log.open("w") as sink:
        child = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True,
                                 env=os.environ | {"PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                pid, status, usage = os.wait4(child.pid, os.WNOHANG)
                if pid:
                    break
                polled_kib = max(polled_kib, vm_hwm_kib(child.pid) or 0)
                if time.monotonic() > deadline:
                    os.killpg(child.pid, signal.SIGKILL)
                if steps_done is not None and train_kib is None and steps_done() >= train_steps:
                    train_kib = vm_hwm_kib(child.pid)
                time.sleep(POLL_S)
        except BaseException:  # Ctrl-C, SIGTERM (peers.py's handler raises): the child and its group go too
            os.killpg(child.pid, signal.SIGKILL)
            os.waitpid(child.pid, 0)
            raise
        child.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    peak_kib = usage.ru_maxrss if usage.ru_maxrss > launcher_kib else polled_kib
    return ChildRun(child.returncode, peak_kib, log.read_text(errors="replace"), train_kib)
