"""GRPO shown to learn, on this CPU: docs/rl.md's "From SFT to GRPO" commands run as written (the data, SFT, the
held-out eval, GRPO, the held-out eval again), timed, with the held-out exact-match accuracy of the SFT and the GRPO
models and GRPO's reward per step; writes benchmarks/results/grpo_arithmetic-cpu.json and the plot docs/rl.md shows
(docs/rl-arithmetic.png).

    python benchmarks/grpo_arithmetic.py                 # the whole chain (a few minutes on a quiet 2-core CPU)
    python benchmarks/grpo_arithmetic.py --tiny --out /tmp/x   # a few steps of each run: that the commands run

The commands are read from the page, not copied here: the page is what a user runs, and the test of --tiny
(tests/benchmarks/test_grpo_arithmetic.py) runs them. Each runs under bash in a fresh folder (`--work`), with
`ember` meaning this checkout's `python -m ember`; --tiny adds max_steps overrides to the two `ember train` lines.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent
ROOT = BENCHMARKS.parent
sys.path[:0] = [str(ROOT), str(BENCHMARKS)]

from results_file import write_results  # noqa: E402

PAGE = ROOT / "docs" / "rl.md"
HEADING = "## From SFT to GRPO, on a CPU"
TINY = {"arith-sft": "max_steps=4 logging_steps=2", "arith-grpo": "max_steps=2 logging_steps=1"}


def page_commands(page: Path = PAGE) -> tuple[list[str], list[str]]:
    """(shell assignments, commands) of the bash block under HEADING: continuation lines joined, comments and the
    pip line dropped."""
    text = page.read_text()
    if HEADING not in text:
        raise SystemExit(f"{page} has no '{HEADING}' section")
    block = re.search(r"```bash\n(.*?)```", text.split(HEADING, 1)[1], re.S)
    lines = block.group(1).replace("\\\n", " ").splitlines()
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in lines]
    lines = [line for line in lines if line and not line.startswith(("#", "pip "))]
    assignments = [line for line in lines if re.match(r"^[A-Z_]+=", line)]
    return assignments, [line for line in lines if line not in assignments]


def run_chain(work: Path, tiny: bool) -> list[dict[str, Any]]:
    assignments, commands = page_commands()
    prelude = "\n".join([
        "set -euo pipefail",
        f'ember() {{ if [ "$1" = train ]; then "{sys.executable}" -m ember "$@" ${{EMBER_TRAIN_EXTRA:-}}; '
        f'else "{sys.executable}" -m ember "$@"; fi; }}',
        *assignments])
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    timed = []
    for command in commands:
        recipe = command.split()[2] if command.startswith("ember train") else None
        extra = TINY.get(recipe, "") if tiny else ""
        print(f"$ {command}{' ' + extra if extra else ''}", flush=True)
        start = time.perf_counter()
        proc = subprocess.run(["bash", "-c", f"{prelude}\n{command}"], cwd=work, text=True, capture_output=True,
                              env={**env, "EMBER_TRAIN_EXTRA": extra})
        seconds = time.perf_counter() - start
        print(proc.stdout[-2000:], proc.stderr[-2000:] if proc.returncode else "", sep="", flush=True)
        if proc.returncode:
            raise SystemExit(f"failed ({proc.returncode}): {command}")
        timed.append({"command": command, "seconds": round(seconds, 1)})
    return timed


def newest_eval(run: Path) -> dict[str, Any]:
    evals = sorted(run.glob("checkpoints/step-*/eval.json"), key=lambda p: int(p.parent.name[5:]))
    return json.loads(evals[-1].read_text())["results"]["gen"]


def plot(curve: list[tuple[int, float]], accuracy: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2), gridspec_kw={"width_ratios": [2, 1]})
    left.plot([s for s, _ in curve], [r for _, r in curve], color="tab:orange")
    left.set(xlabel="GRPO step", ylabel="mean reward (exact)", title="reward of the sampled completions", ylim=(0, 1))
    right.bar(list(accuracy), list(accuracy.values()), color=["tab:blue", "tab:orange"])
    for i, value in enumerate(accuracy.values()):
        right.text(i, value + 0.02, f"{value:.2f}", ha="center")
    right.set(ylabel="exact match", title="held-out accuracy (greedy)", ylim=(0, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a few steps of each run (the test's)")
    parser.add_argument("--work", type=Path, help="where the chain runs (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=BENCHMARKS / "results")
    parser.add_argument("--plot", type=Path, default=None, help="default: docs/rl-arithmetic.png (--tiny: --out)")
    parser.add_argument("--note", default="", help="kept in the JSON (e.g. what else ran on the machine)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="grpo-arithmetic-"))
    work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    commands = run_chain(work, args.tiny)
    total = time.perf_counter() - start
    sft, grpo = newest_eval(work / "outputs" / "arith-sft"), newest_eval(work / "outputs" / "arith-grpo")
    metrics = work / "outputs" / "arith-grpo" / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    curve = [(r["step"], r["grpo/reward"]) for r in records if "grpo/reward" in r]
    accuracy = {"SFT": sft["exact"], "GRPO": grpo["exact"]}
    rows = [{"model": name, "heldout_exact": value, "heldout_rows": evaluated["n"],
             "completion_tokens": evaluated["completion_tokens"]}
            for (name, value), evaluated in zip(accuracy.items(), (sft, grpo))]
    name = "grpo_arithmetic-tiny" if args.tiny else "grpo_arithmetic"
    config = {key: str(value) if isinstance(value, Path) and key != "out" else value
              for key, value in vars(args).items()}
    write_results(name, rows, argparse.Namespace(**config, device="cpu"), total_s=round(total, 1),
                  commands=commands, reward_curve=curve, note=args.note)
    plot(curve, accuracy, args.plot or (args.out / "rl-arithmetic.png" if args.tiny else ROOT / "docs" /
                                        "rl-arithmetic.png"))
    print(f"held-out exact match: SFT {accuracy['SFT']:.3f} -> GRPO {accuracy['GRPO']:.3f}; reward "
          f"{curve[0][1]:.3f} (step {curve[0][0]}) -> {curve[-1][1]:.3f} (step {curve[-1][0]}); {total:.0f} s in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
