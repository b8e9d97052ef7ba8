"""What the peer runners share: their command line and the file of facts benchmarks/peers.py reads.

Runners run under the peers' own environment (.venv-peers), which has no ember: this module is stdlib only.
What a runner knows of its run it records in OUT/peers.jsonl (FACTS_FILE), one {"kind", "value"} per line:
`params` (the model's parameter count, checked equal across frameworks), `patch` (a change made at run time to
get the framework running here), `version` ("NAME VERSION"). Each is printed too, as `PEERS KIND VALUE`, for
whoever reads the run's output; peers.py reads the file, never the output.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

FACTS_FILE = "peers.jsonl"  # benchmarks/peers_frameworks.py's FACTS_FILE
# Where say() records: set once by parse_args. A module-level path because the patches that say what they
# change run deep inside the frameworks' import sequence, far from the run's arguments.
_facts: Optional[Path] = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The run every contestant is given: the Llama shape, batch, optimizer, precision and mode."""
    parser = argparse.ArgumentParser(description="one peer training run, for benchmarks/peers.py")
    for name in ("dim", "n-layers", "n-heads", "n-kv-heads", "vocab", "ffn-hidden", "batch", "seq", "steps"):
        parser.add_argument(f"--{name}", type=int, required=True)
    parser.add_argument("--rope-theta", type=float, default=500000.0)
    parser.add_argument("--norm-eps", type=float, default=1e-5)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--betas", type=float, nargs=2, default=[0.9, 0.95])
    parser.add_argument("--eps", type=float, default=1e-8)
    parser.add_argument("--max-norm", type=float, default=1.0)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--mode", choices=("eager", "compiled"), default="eager")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="the run's output folder")
    run = parser.parse_args(argv)
    global _facts
    _facts = Path(run.out) / FACTS_FILE
    return run


def append_jsonl(path: Path | str, record: dict[str, Any]) -> None:
    """One JSON line appended and closed at once, so that a reader polling the file (peers.py, for the steps
    done so far) sees whole lines, and a crash that follows loses nothing. Values JSON has no type for (a
    framework's tensors, say) are written as numbers where they are numbers, else as text."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record, default=lambda v: float(v) if hasattr(v, "__float__") else str(v))
    with open(path, "a") as sink:
        sink.write(line + "\n")


def say(kind: str, value: object) -> None:
    """One fact of the run (`params`, `patch`, `version`) recorded for peers.py, and printed."""
    if _facts is None:
        raise RuntimeError("say() before parse_args(): the run's output folder is not known yet")
    append_jsonl(_facts, {"kind": kind, "value": value})
    print(f"PEERS {kind} {value}", flush=True)
    sys.stderr.flush()
