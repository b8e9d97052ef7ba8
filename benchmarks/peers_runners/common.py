"""What the peer runners share: their command line and the tagged lines benchmarks/peers.py reads.

Runners run under the peers' own environment (.venv-peers), which has no ember: this module is stdlib only.
Every line a runner adds to its framework's own output starts with `PEERS `: `PEERS params N` (the model's
parameter count, checked equal across frameworks), `PEERS patch TEXT` (a change made at run time to get the
framework running here), `PEERS version NAME VERSION`.
"""

from __future__ import annotations

import argparse
import sys


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
    return parser.parse_args(argv)


def say(kind: str, text: object) -> None:
    """One tagged line for peers.py, flushed at once so that it survives a crash that follows."""
    print(f"PEERS {kind} {text}", flush=True)
    sys.stderr.flush()
