"""A jax.profiler trace (the trace.json.gz it writes beside the xplane) summed by XLA op kind, in busy thread-ms per
device and step: what benchmarks/maxtext_peer.py --profile compares between two XLA programs that should cost the
same. Thread-ms, not wall time: an op that runs on two threads counts twice, so a kind's figure (and "ops", their
sum) can exceed the step's wall time ("step"); on devices that share few cores an op's span also holds the time
its thread waited for a core.

On jax's CPU backend each device runs its program on XLA's threads (tf_XLAEigen, tf_XLAExecute, tf_XLAPjRtCpuClient);
an op is one complete event there named after its HLO instruction (`ynn_fusion.12`, `all-gather.3`). Nested
events (a collective's Rendezvous, the executor's waits) are left out so that no time is counted twice.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

XLA_THREADS = ("tf_XLAEigen", "tf_XLAExecute", "tf_XLAPjRtCpuClient")
NESTED = ("ThunkExecutor", "Rendezvous", "Wait", "InvokeRendezvous", "while", "call", "conditional")
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def op_kind(name: str) -> str | None:
    """The kind an XLA op's event counts under, or None for a container or wait event."""
    base = re.sub(r"\.\d+$", "", name)
    if base.startswith(NESTED) or base.startswith("$"):
        return None
    if base in COLLECTIVES:
        return base
    if base.startswith("ynn_fusion") or base in ("dot", "convolution") or "dot" in base.split("_"):
        return "matmul"
    if base in ("copy", "transpose") or base.startswith(("copy", "transpose")):
        return "copy/transpose"
    return "other"


def step_windows(events: list[dict[str, Any]], threads: dict[tuple[int, int], str], devices: int,
                 steps: int) -> list[tuple[float, float]]:
    """(start, end) in microseconds of the last `steps` train steps: each device's run of the train program is one
    long `ThunkExecutor::Execute (wait for completion)` event on an XLA thread; the devices' runs overlap, and a
    step is one such overlapping group, from the first start to the last end (a trace may miss a device's event at
    its edge; programs a trainer runs beside, shorter than half the longest run, are not steps)."""
    runs = [e for e in events if e["name"] == "ThunkExecutor::Execute (wait for completion)"
            and threads.get((e["pid"], e["tid"]), "").startswith(XLA_THREADS)]
    longest = max((e["dur"] for e in runs), default=0.0)
    groups: list[list[dict[str, Any]]] = []
    for e in sorted((e for e in runs if e["dur"] >= longest / 2), key=lambda e: e["ts"]):
        if groups and e["ts"] < min(r["ts"] + r["dur"] for r in groups[-1]):
            groups[-1].append(e)  # started while this step's runs were still running: the same step
        else:
            groups.append([e])
    if len(groups) < steps:
        raise ValueError(f"the trace holds {len(groups)} runs of the train program, not {steps}")
    return [(min(e["ts"] for e in g), max(e["ts"] + e["dur"] for e in g)) for g in groups[-steps:]]


def summarize(trace: Path, devices: int, steps: int) -> dict[str, Any]:
    """Busy thread-ms per device and step of each op kind in the last `steps` train steps of a trace, their sum
    ("ops"), a step's wall time in ms ("step") and the ms a step in which no XLA thread ran an op ("idle")."""
    data = json.load(gzip.open(trace))
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in data["traceEvents"]
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    events = [e for e in data["traceEvents"] if e.get("ph") == "X"]
    windows = step_windows(events, threads, devices, steps)
    totals: dict[str, float] = {}
    spans = []
    for e in events:
        kind = op_kind(e["name"])
        if kind is None or not threads.get((e["pid"], e["tid"]), "").startswith(XLA_THREADS):
            continue
        for start, end in windows:
            lo, hi = max(e["ts"], start), min(e["ts"] + e["dur"], end)
            if hi > lo:
                totals[kind] = totals.get(kind, 0.0) + (hi - lo)
                spans.append((lo, hi))
    busy, reach = 0.0, 0.0
    for lo, hi in sorted(spans):  # the union of every op's span: when some device thread ran an op
        busy += max(0.0, hi - max(lo, reach))
        reach = max(reach, hi)
    wall = sum(end - start for start, end in windows)
    per = 1e3 * devices * steps  # trace times are microseconds
    summary = {kind: round(total / per, 2) for kind, total in sorted(totals.items())}
    summary["ops"] = round(sum(totals.values()) / per, 2)
    summary["step"] = round(wall / 1e3 / steps, 2)
    summary["idle"] = round((wall - busy) / 1e3 / steps, 2)
    return summary


def find_trace(folder: Path) -> Path:
    """The one trace.json.gz jax.profiler wrote under `folder`."""
    found = sorted(folder.rglob("*.trace.json.gz"))
    if len(found) != 1:
        raise ValueError(f"{folder} holds {len(found)} jax.profiler traces, not 1")
    return found[0]
