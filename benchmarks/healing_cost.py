"""What a failed replica group costs a fault-tolerant job (fault_tolerance.*, torchft): the survivors' lost time, and
how long a restarted group takes to heal from a live peer, beside a restart of the whole job from its checkpoint.

Two groups of one process train the same model on this machine (torchft's lighthouse started here). Group 1 is
killed (SIGKILL) at step K and started again at once. Each group's console lines are read as they come, stamped:
- the survivor's step times: its median step, and the step during which group 1 died (the failed attempt, the
  quorum without it, the step run again);
- the restarted group: process start -> "healed from a live peer" (start-up, build, the quorum, the copy of the
  weights, optimizer state, schedule, data position and RNG) and -> its first step after healing;
- for comparison, a group's start-up alone: process start -> its first step, from the first launch.

    python benchmarks/healing_cost.py                       # debug model, 8 layers x dim 512
    python benchmarks/healing_cost.py model.n_layers=4

Writes benchmarks/results/healing_cost-cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
BASE = ["data.dataset=synthetic", "model.n_layers=8", "model.dim=512", "model.n_heads=8", "model.n_kv_heads=4",
        "seq_len=128", "global_batch_size=4", "micro_batch_size=2", "logging_steps=1", "metrics.tensorboard=false",
        "fault_tolerance.enable=true", "fault_tolerance.replica_groups=2", "fault_tolerance.timeout_s=30"]
STEP_LINE = re.compile(r"^step\s+(\d+)\s+loss")


class Group:
    """One replica group's process, its stdout lines stamped with the monotonic time they arrived."""

    def __init__(self, group: int, argv: list[str], env: dict[str, str]):
        self.start = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "ember", "train", "debug", *argv], cwd=ROOT, text=True,
                                     env=dict(env, EMBER_REPLICA_GROUP=str(group)), stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL)
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def steps(self) -> dict[int, float]:
        return {int(m[1]): t for t, line in self.lines if (m := STEP_LINE.match(line))}

    def first(self, text: str) -> float:
        return next(t for t, line in self.lines if text in line)

    def wait_for_step(self, step: int) -> None:
        while step not in self.steps():
            if self.proc.poll() is not None:
                raise SystemExit(f"group exited with {self.proc.returncode} before step {step}")
            time.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-at", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    from ember.launch.replica_groups import _free_port
    from ember.train.fault_tolerance import lighthouse_command

    port = _free_port()
    lighthouse = subprocess.Popen(lighthouse_command(port, 1, join_timeout_ms=5000), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
    env = dict(os.environ, TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}", OMP_NUM_THREADS="1")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            argv = [*BASE, *args.overrides, f"max_steps={args.steps}", f"output_dir={tmp}/run"]
            groups = [Group(g, argv, env) for g in range(2)]
            groups[1].wait_for_step(args.kill_at)
            startup = groups[1].steps()[1] - groups[1].start
            groups[1].proc.send_signal(signal.SIGKILL)
            groups[1].proc.wait()
            groups[1] = Group(1, argv, env)
            for g in groups:
                g.proc.wait()
                g.reader.join()
            if any(g.proc.returncode for g in groups):
                raise SystemExit(f"a group failed: {[g.proc.returncode for g in groups]}")
            survivor, healed = groups[0].steps(), groups[1]
            times = sorted(survivor.items())
            durations = {step: t - times[i - 1][1] for i, (step, t) in enumerate(times) if i > 0}
            failed = args.kill_at + 1
            plain = statistics.median(d for s, d in durations.items() if s not in (failed, failed + 1))
            heal_at = healed.first("healed from a live peer")
            first_after = min(healed.steps().items())[1]
            header = next(line for _, line in groups[0].lines if " params" in line)
            n_params = int(re.search(r"([\d,]+) params", header)[1].replace(",", ""))
    finally:
        lighthouse.terminate()
        lighthouse.wait()
    row = {"params": n_params, "state_mb": n_params * 4 * 3 / 2**20,  # fp32 weights + AdamW's two moments
           "plain_step_s": plain, "failed_step_s": durations[failed], "lost_s": durations[failed] - plain,
           "restart_to_healed_s": heal_at - healed.start, "restart_to_first_step_s": first_after - healed.start,
           "fresh_start_to_first_step_s": startup}
    print(f"{n_params:,} params ({row['state_mb']:.0f} MB of weights and optimizer state); plain step "
          f"{plain * 1e3:.0f} ms; the step group 1 died in: {durations[failed] * 1e3:.0f} ms "
          f"({row['lost_s']:.1f} s lost by the survivor)")
    print(f"restarted group: healed {row['restart_to_healed_s']:.1f} s after its start, first step at "
          f"{row['restart_to_first_step_s']:.1f} s; a fresh start's first step: {startup:.1f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "healing_cost-cpu.json"
    out.write_text(json.dumps({"date": date.today().isoformat(), "machine": f"{platform.machine()} "
                               f"{os.cpu_count()} cores", "torch": torch.__version__,
                               "command": [sys.executable, *sys.argv], "row": row}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
