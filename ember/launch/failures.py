"""The rank that failed first, from a job's log (all nodes' output in one file, as SLURM writes it).

When one rank dies, its peers fail a moment later in their next collective ("Connection closed by peer", a
NCCL timeout): those errors are consequences and are printed too, sometimes before the cause reaches the log.
So the cause is, in order: the first rank error that is not a communication error (ember prints each rank's
error as `error: [rank R] ...`); else a rank that torchrun saw die of a signal (SIGKILL from the OOM killer,
a segfault: it printed nothing itself); else the first rank error of any kind; else the first failure that
torchrun reported.

    python -m ember.launch.failures LOG      prints that rank (the sbatch script runs it when a job fails)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Optional

START = re.compile(r"^ember: job \S+ started", re.MULTILINE)  # the sbatch script's first line, once per start
RANK_ERROR = re.compile(r"^error: \[rank (\d+)\] (.*)$", re.MULTILINE)
# torchrun's ChildFailedError report: "rank      : 1 (local_rank: 0)" then "exitcode  : -9 (pid: 123)"
TORCHRUN_FAILURE = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n.*?exitcode\s*:\s*(-?\d+)", re.MULTILINE)
COMMUNICATION = re.compile(r"Connection (closed|reset) by peer|Broken pipe|timed out|Timeout|DistNetworkError|"
                           r"DistBackendError|NCCL (error|communicator)|ProcessGroup\w* .*(abort|error)|"
                           r"remote process exited|Socket Timeout|Connection refused", re.IGNORECASE)


def current_run(log: str) -> str:
    """The part of the log written by the job's latest start (a requeued job appends to the same file)."""
    starts = [m.start() for m in START.finditer(log)]
    return log[starts[-1]:] if starts else log


def first_failure(log: str) -> Optional[str]:
    """'first failing rank: R (...)' for the job's latest start, or None when no rank failed."""
    log = current_run(log)
    errors = [(int(rank), message.strip()) for rank, message in RANK_ERROR.findall(log)]
    killed = [(int(rank), int(code)) for rank, code in TORCHRUN_FAILURE.findall(log)]
    for rank, message in errors:
        if not COMMUNICATION.search(message):
            return f"first failing rank: {rank} ({message})"
    for rank, code in killed:
        if code < 0:
            return f"first failing rank: {rank} (killed by signal {-code}{_signal_name(-code)})"
    if errors:
        rank, message = errors[0]
        return f"first failing rank: {rank} ({message})"
    if killed:
        rank, code = killed[0]
        return f"first failing rank: {rank} (exit code {code})"
    return None


def _signal_name(number: int) -> str:
    import signal

    try:
        return f", {signal.Signals(number).name}"
    except ValueError:
        return ""


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m ember.launch.failures LOG", file=sys.stderr)
        return 2
    culprit = first_failure(Path(argv[0]).read_text(errors="replace"))
    print(f"ember: {culprit}" if culprit else "ember: no rank reported an error (see the log above)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
