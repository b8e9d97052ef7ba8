"""The JSON every benchmark writes to benchmarks/results/: what was measured, on what, when, with what."""

from __future__ import annotations

import argparse
import json
import os
import platform
from datetime import date
from pathlib import Path
from typing import Any

import torch


def cpu_bf16_words() -> str:
    """Whether this CPU has bf16 matmul instructions: it decides precision=auto and every bf16 figure."""
    from ember.hardware.device import cpu_runs_bf16_natively

    return "bf16 matmul instructions" if cpu_runs_bf16_natively() else "no bf16 matmul instructions"


def write_results(name: str, rows: list[dict[str, Any]], args: argparse.Namespace, **versions: Any) -> Path:
    """benchmarks/results/<name>-<cuda|cpu>.json (args.out: the folder) with the date, machine, torch version,
    the given library `versions` (and any other top-level fields, such as peers.py's `interrupted`), the
    command-line config and the rows; prints and returns the path."""
    # where it ran: the benchmark's own --device when that names one, else the GPU when there is one
    device = getattr(args, "device", None)
    device = device if device in ("cuda", "cpu") else ("cuda" if torch.cuda.is_available() else "cpu")
    machine = (f"{torch.cuda.get_device_name()}, {os.cpu_count()} CPU cores" if device == "cuda"
               else f"{platform.machine()} cpu, {torch.get_num_threads()} threads, {cpu_bf16_words()}")
    result = {"benchmark": name, "date": date.today().isoformat(), "machine": machine,
              "torch": torch.__version__, **versions, "config": vars(args) | {"out": str(args.out)}, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{name}-{device}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return path
