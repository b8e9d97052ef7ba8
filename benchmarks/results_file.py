"""The JSON every benchmark writes to benchmarks/results/: what was measured, on what, when, with what."""

from __future__ import annotations

import argparse
import json
import platform
from datetime import date
from pathlib import Path
from typing import Any

import torch


def write_results(name: str, rows: list[dict[str, Any]], args: argparse.Namespace, **versions: str) -> Path:
    """benchmarks/results/<name>-<cuda|cpu>.json (args.out: the folder) with the date, machine, torch version,
    the given library `versions`, the command-line config and the rows; prints and returns the path."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = {"benchmark": name, "date": date.today().isoformat(),
              "machine": f"{platform.machine()} {device}, {torch.get_num_threads()} threads",
              "torch": torch.__version__, **versions, "config": vars(args) | {"out": str(args.out)}, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{name}-{device}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return path
