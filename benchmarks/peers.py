"""Training tokens/s and peak memory: ember beside litgpt and torchtitan, the same Llama trained by each
framework's own trainer in a fresh process, with the same batch, AdamW settings, clipping and precision.

    python benchmarks/peers.py                                      # debug, 56m, 128k; fp32, bf16; eager + compiled
    python benchmarks/peers.py --shapes tiny --rounds 1 --steps 6 --warmup 2
    python benchmarks/peers.py --shapes debug --modes eager --frameworks ember,torchtitan --device cuda

ember runs `ember train debug` with overrides; litgpt its pretraining entry (`litgpt.pretrain.setup`, what
`litgpt pretrain` calls, which always torch.compiles: it has no eager row); torchtitan its trainer
(`torchtitan.train.main`, ConfigManager and all) with a few run-time changes that get it running on a CPU,
listed in the output (benchmarks/peers_runners/). The peers run in their own environment, never ember's, at the
versions benchmarks/requirements-peers.txt pins:

    python -m venv .venv-peers && .venv-peers/bin/pip install torch==2.13.0 \\
        && .venv-peers/bin/pip install torch==2.13.0 -r benchmarks/requirements-peers.txt

Each framework's step time is its own, read from a file the run writes (benchmarks/peers_frameworks.py): ember's
`step_time_s` in its metrics.jsonl (data wait included), litgpt's `iter_time` in its CSV logger's metrics.csv
(forward, backward, clipping, optimizer step and a loss sync; not the data fetch), torchtitan's
`time_metrics/end_to_end(s)` in the per-step record of its MetricsProcessor (the time between two logged steps:
all of a step). The parameter counts the runs record must agree.
The first `--warmup` steps are dropped (compiled runs: `--warmup-compiled`), the median of the rest gives
tokens/s; each round is a fresh process per framework, the order rotated each round, the figure per framework
the median over rounds. `ember/this` is ember's tokens/s over the row's. Train RSS is the child's peak resident
memory (VmHWM) once its files show all but its last step: the memory training needs, without what a framework
does after it (ember's final evaluation and checkpoint, litgpt's checkpoint); peak RSS is the whole process's
ru_maxrss (benchmarks/peers_rss.py). Compile workers a child starts are in neither.
Run it on an otherwise idle machine: on a small CPU another busy process slows the small ops of a step many
times over (torch's threads wait for each other), and not every framework alike.

Writes benchmarks/results/peers-<device>.json (--out: another folder), with ember's version and commit and the
warnings printed on the way; a row whose kept step times vary over 1.5x in a round is marked noisy (`"noisy":
true` and its `step_spread`, in the table and the summary too). Ctrl-C (exit 130) or SIGTERM (exit 143) writes
the rows finished so far there, marked `"interrupted": true`.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).parent))  # benchmarks/ is a folder of scripts: its modules by file name
import peers_env as env  # noqa: E402
import peers_frameworks as frameworks  # noqa: E402
import peers_rss as rss  # noqa: E402
import peers_table as table  # noqa: E402
from ember.errors import ConfigError, EmberError  # noqa: E402
from ember.hardware.device import cpu_runs_bf16_natively  # noqa: E402
from results_file import write_results  # noqa: E402

REPO = env.REPO
RUNNERS = frameworks.RUNNERS
SHAPES = frameworks.SHAPES
FRAMEWORKS = tuple(RUNNERS)
# A round whose kept step times (slowest over fastest) vary more than this is noisy: warned of, its row marked.
NOISY_SPREAD = 1.5
NOTES = (f"step times are each framework's own: {', '.join(runner.timing for runner in RUNNERS.values())}; "
         "litgpt's pretraining always compiles")


def bf16_skip_reason(device: str, force: bool, native: bool) -> Optional[str]:
    """Why bf16 rows are not run here, or None: a CPU without bf16 matmul instructions emulates them."""
    if device != "cpu" or force or native:
        return None
    return ("this CPU has no bf16 matmul instructions (AVX512-BF16, AMX or ARM BF16), so torch emulates "
            "bf16 far slower than fp32; --force-bf16 runs it anyway")


def steady_step_time(step_times: list[float], warmup: int) -> float:
    """The median step time once the first `warmup` steps (allocation, compilation) are dropped."""
    steady = step_times[warmup:]
    if not steady:
        raise ValueError(f"{len(step_times)} step times, none left after dropping {warmup} warmup steps")
    return statistics.median(steady)


def check_param_counts(shape: str, counts: dict[str, int]) -> None:
    """Refuse a comparison of models that are not the same: every framework's count must be the same."""
    (first, expected), *rest = counts.items()
    for name, count in rest:
        if count != expected:
            raise ConfigError(f"shape {shape}: {first} builds {expected:,} parameters but {name} {count:,}: "
                              "not the same model, so the comparison would not mean anything")


def steps_logged(runner: frameworks.Runner, out: Path) -> int:
    """The training steps a running child's files show so far; a file caught in the middle of a rewrite (litgpt's
    CSV logger rewrites its file when a column appears) counts as none yet: it is read again at the next poll."""
    try:
        return len(runner.read(out).step_times_s)
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def judge(framework: str, shape: frameworks.Shape, measured: frameworks.Measured, child: rss.ChildRun,
          warmup: int, timeout_s: float, unreadable: Optional[str] = None) -> dict[str, Any]:
    """One round's result from what its files said and how its process ended: {status: ok, tokens_per_s,
    step_s, step_spread, noisy, warning, ...} or {status: failed, reason}, with the raw figures either way."""
    times = measured.step_times_s
    result = {"params": measured.params, "peak_rss_kib": child.peak_kib, "train_rss_kib": child.train_kib,
              "step_times_s": times, "patches": measured.patches, "versions": measured.versions}
    reason = (f"killed (SIGKILL: the {timeout_s:.0f} s --timeout, or out of memory)" if child.code == rss.KILLED
              else f"exit code {child.code}" if child.code != 0
              else f"unreadable metrics files ({unreadable})" if unreadable
              else f"{len(times)} step times in its metrics files, not more than the {warmup} warmup"
              if len(times) <= warmup
              else "no parameter count in its files" if measured.params is None else None)
    if reason is not None:
        tail = child.output.strip().splitlines()[-1:]
        return result | {"status": "failed", "reason": reason + (f": {tail[0][:200]}" if tail else ", no output")}
    step = steady_step_time(times, warmup)
    kept = times[warmup:]
    spread = max(kept) / min(kept)
    noisy = spread > NOISY_SPREAD  # still warming up, recompiling, or a busy machine
    warning = (f"{framework}'s kept step times vary {spread:.1f}x ({min(kept) * 1e3:.0f}-{max(kept) * 1e3:.0f} ms): "
               "raise --steps/--warmup, or idle the machine") if noisy else None
    return result | {"status": "ok", "step_s": step, "tokens_per_s": shape.batch * shape.seq / step,
                     "step_spread": spread, "noisy": noisy, "warning": warning}


def measure(framework: str, shape_name: str, precision: str, mode: str, args: argparse.Namespace,
            peers_python: Optional[Path]) -> dict[str, Any]:
    """One fresh-process run of `framework` (see judge for what it returns)."""
    runner, shape = RUNNERS[framework], SHAPES[shape_name]
    with tempfile.TemporaryDirectory(prefix=f"peers-{framework}-") as tmp:
        job = frameworks.Job(shape, precision, mode, args.steps, args.device, Path(tmp) / "run", peers_python)
        cmd = runner.command(job)
        print(f"  {framework:<11} {shape_name} {precision} {mode} ...", flush=True)
        child = rss.run_child(cmd, Path(tmp) / "output.log", args.timeout, REPO,
                              lambda: steps_logged(runner, job.out), args.steps - 1)
        try:
            measured, unreadable = runner.read(job.out), None
        except (OSError, ValueError, KeyError, TypeError) as err:  # a file in another format than expected
            measured, unreadable = frameworks.Measured([], None), f"{type(err).__name__}: {err}"
    warmup = args.warmup_compiled if mode == "compiled" else args.warmup
    result = judge(framework, shape, measured, child, warmup, args.timeout, unreadable)
    if result.get("warning"):
        print(f"  warning: {result['warning']}", flush=True)
    if result["status"] != "ok":
        tail = "\n".join(child.output.strip().splitlines()[-30:]) or "(no output)"
        print(f"  {framework} failed ({result['reason']}): {' '.join(cmd)}\n{tail}", file=sys.stderr, flush=True)
    return result


def run_group(shape: str, precision: str, mode: str, args: argparse.Namespace, peers_python: Optional[Path],
              bf16_skip: Optional[str], counts: dict[str, int]) -> tuple[list[dict[str, Any]], list[str]]:
    """One (shape, precision, mode)'s rows, and what its runs recorded (torchtitan's patches, the peers'
    versions) with the warnings printed about them, as tags (`patch TEXT`, `version TEXT`, `warning TEXT`).
    Each round starts every framework afresh, the order rotated each round so that drift of the machine does
    not favour one; `counts` (framework -> parameters, this shape's) must stay equal."""
    rows, runnable, tags = [], [], []
    for framework in args.frameworks:
        if precision == "bf16" and bf16_skip:
            rows.append(table.not_run(shape, precision, mode, framework, "skipped", bf16_skip))
        elif mode in RUNNERS[framework].no_run:
            rows.append(table.not_run(shape, precision, mode, framework, "n/a", RUNNERS[framework].no_run[mode]))
        else:
            runnable.append(framework)
    rounds: dict[str, list] = {framework: [] for framework in runnable}
    for index in range(args.rounds if runnable else 0):
        for framework in runnable[index % len(runnable):] + runnable[:index % len(runnable)]:
            result = measure(framework, shape, precision, mode, args, peers_python)
            rounds[framework].append(result)
            tags += [f"patch {p}" for p in result["patches"]] + [f"version {v}" for v in result["versions"]]
            if result.get("warning"):
                tags.append(f"warning {shape} {precision} {mode} round {index + 1}: {result['warning']}")
            if result["params"] is not None:
                check_param_counts(shape, counts | {framework: result["params"]})
                counts.setdefault(framework, result["params"])
    summed = [table.summarize(shape, precision, mode, framework, rounds[framework]) for framework in runnable]
    return rows + summed, tags


def run_all(args: argparse.Namespace, peers_python: Optional[Path], bf16_skip: Optional[str],
            rows: list[dict[str, Any]], tags: list[str]) -> None:
    """Every (shape, precision, mode, framework) row, appended to `rows` as its group finishes, and its runs'
    tags to `tags`: what a Ctrl-C leaves there has finished."""
    counts: dict[str, dict[str, int]] = {}
    for shape in args.shapes:
        for precision in args.precisions:
            for mode in args.modes:
                group, recorded = run_group(shape, precision, mode, args, peers_python, bf16_skip,
                                            counts.setdefault(shape, {}))
                rows += group
                tags += recorded


def tagged_as(tags: list[str], kind: str) -> list[str]:
    """The texts of run_all's `kind` tags (`patch`, `version`, `warning`), in order, each once."""
    return list(dict.fromkeys(t.split(" ", 1)[1] for t in tags if t.startswith(f"{kind} ")))


def comma_list(text: str) -> list[str]:
    return [value for value in text.split(",") if value]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # every help says its default (the lists' defaults are strings that argparse passes through comma_list,
    # so that --help shows them as they are typed) and, where there are any, the choices
    parser.add_argument("--shapes", type=comma_list, default="debug,56m,128k",
                        help=f"comma-separated, of {', '.join(SHAPES)} (default: %(default)s)")
    parser.add_argument("--precisions", type=comma_list, default="fp32,bf16",
                        help="comma-separated, of fp32, bf16 (default: %(default)s; bf16 is skipped on a CPU without "
                             "bf16 instructions, see --force-bf16)")
    parser.add_argument("--modes", type=comma_list, default="eager,compiled",
                        help="comma-separated, of eager, compiled (default: %(default)s)")
    parser.add_argument("--frameworks", type=comma_list, default=",".join(FRAMEWORKS),
                        help=f"comma-separated, of {', '.join(FRAMEWORKS)} (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="fresh processes per framework and row (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=15, help="training steps per process (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="first steps dropped from an eager run's median (default: %(default)s)")
    parser.add_argument("--warmup-compiled", type=int, default=None,
                        help="first steps dropped from a compiled run's median (default: --warmup + 2)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where every framework trains, cpu or cuda (default: %(default)s)")
    parser.add_argument("--force-bf16", action="store_true",
                        help="run bf16 on a CPU without bf16 instructions (default: off: such a CPU skips bf16)")
    parser.add_argument("--peers-python", default=None, help="the peers' python (default: $EMBER_PEERS_PYTHON, "
                        "else .venv-peers/bin/python)")
    parser.add_argument("--timeout", type=float, default=1800,
                        help="seconds before a child is killed (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results",
                        help="the folder the results file peers-<device>.json is written to (default: "
                             "benchmarks/results, beside this script); created if missing")
    args = parser.parse_args(argv)
    warmup_compiled_given = args.warmup_compiled is not None
    args.warmup_compiled = args.warmup_compiled if warmup_compiled_given else args.warmup + 2
    for key, allowed in (("shapes", SHAPES), ("precisions", ("fp32", "bf16")), ("modes", ("eager", "compiled")),
                         ("frameworks", FRAMEWORKS)):
        unknown = [v for v in getattr(args, key) if v not in allowed]
        if unknown or not getattr(args, key):
            raise ConfigError(f"--{key} {','.join(unknown) or '(empty)'}: choose from {','.join(allowed)}")
    for key in ("rounds", "timeout", "warmup", "warmup_compiled"):
        value = getattr(args, key)
        positive = key in ("rounds", "timeout")  # a count of nothing or no time measures nothing
        if value is not None and (value < 0 or (value == 0 and positive)):
            raise ConfigError(f"--{key.replace('_', '-')} {value:g}: must be {'positive' if positive else '>= 0'}")
    if args.out.exists() and not args.out.is_dir():
        raise ConfigError(f"--out {args.out}: a file, not a folder; name the folder the results file goes in")
    # only the modes that run drop warmup steps; the error names the option that drops the most
    eager_warmup = args.warmup if "eager" in args.modes else 0
    compiled_warmup = args.warmup_compiled if "compiled" in args.modes else 0
    if args.steps <= max(eager_warmup, compiled_warmup):
        if compiled_warmup >= eager_warmup:
            option, warmup, other_mode, other_warmup = "--warmup-compiled", compiled_warmup, "eager", args.warmup
        else:
            option, warmup, other_mode, other_warmup = "--warmup", eager_warmup, "compiled", args.warmup_compiled
        origin = " (its default: --warmup + 2)" if option == "--warmup-compiled" and not warmup_compiled_given else ""
        # the other mode alone is a way out only where its own warmup leaves a step
        fixes = ["raise --steps", f"lower {option}"] + ([f"run --modes {other_mode}"] if args.steps > other_warmup
                                                          else [])
        raise ConfigError(f"--steps {args.steps} leaves no step after the {warmup} warmup steps of {option}{origin}: "
                          f"{', '.join(fixes[:-1])}, or {fixes[-1]}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: torch sees no CUDA device here; use --device cpu")
    return args


class Stopped(BaseException):
    """A SIGTERM, raised in the main thread as Ctrl-C raises KeyboardInterrupt, so that both unwind alike (the
    running child killed, the finished rows written); a BaseException, so that no `except Exception` keeps it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop(signum: int, _frame: Any) -> None:
    raise Stopped(signum)


def report(rows: list[dict[str, Any]], tags: list[str], args: argparse.Namespace, peers_python: Optional[Path],
           source: dict[str, Optional[str]], interrupted: bool) -> Path:
    """Prints the table, the summary and torchtitan's patches; writes the results file (with ember's `source`,
    the versions, the warnings printed on the way and, for a run stopped by Ctrl-C or SIGTERM, `"interrupted":
    true`) and returns its path."""
    table.add_ember_ratios(rows)
    table.print_table(rows)
    summary, patches = table.summary_lines(rows), tagged_as(tags, "patch")
    print(f"\n{table.summary_heading(rows)}")
    print("\n".join(f"  {line}" for line in summary) or "  (no row where ember and a peer both ran)")
    if patches:
        print("\ntorchtitan's run-time patches:\n" + "\n".join(f"  {p}" for p in patches))
    versions = env.peer_versions(tagged_as(tags, "version"), args.frameworks, peers_python)
    args.peers_python = str(peers_python) if peers_python else None
    extra = {"summary": "; ".join(summary), "torchtitan_patches": "; ".join(patches),
             "warnings": "; ".join(tagged_as(tags, "warning")), "notes": NOTES}
    return write_results("peers", rows, args, **source, **versions,
                         **{key: value for key, value in extra.items() if value},
                         **({"interrupted": True} if interrupted else {}))


def main(argv: Optional[list[str]] = None) -> int:
    signal.signal(signal.SIGTERM, _stop)  # unwinds like Ctrl-C: the running child killed, its folder removed
    rows: list[dict[str, Any]] = []  # filled as each group finishes, so that a Ctrl-C keeps the finished ones
    tags: list[str] = []
    peers_python: Optional[Path] = None
    source: dict[str, Optional[str]] = {}
    try:
        args = parse_args(argv)
        # the code that runs, taken before it runs: an edit or a commit during a long run does not change it
        source = {"ember": env.ember_version(), "ember_commit": env.git_commit(REPO)}
        peers = [f for f in args.frameworks if f != "ember"]
        peers_python = env.find_peers_python(args.peers_python, dict(os.environ)) if peers else None
        native = args.device == "cuda" or cpu_runs_bf16_natively()
        run_all(args, peers_python, bf16_skip_reason(args.device, args.force_bf16, native), rows, tags)
    except EmberError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Stopped) as stop:
        signum = stop.signum if isinstance(stop, Stopped) else signal.SIGINT
        how = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
        measured = [r for r in rows if r.get("rounds")]  # skipped and n/a rows were never run: they say nothing
        if not measured:
            print(f"peers.py: {how} before any row finished; no results written", file=sys.stderr)
            return 128 + signum  # the shell's status for a death by that signal: 130 for Ctrl-C, 143 for SIGTERM
        path = report(rows, tags, args, peers_python, source, interrupted=True)
        finished = f"the {len(measured)} rows that finished are" if len(measured) > 1 else "the row that finished is"
        print(f'peers.py: {how}; {finished} in {path} (marked "interrupted": true)', file=sys.stderr)
        return 128 + signum
    report(rows, tags, args, peers_python, source, interrupted=False)
    failed = [r for r in rows if r["status"] == "failed" or any(x["status"] != "ok" for x in r.get("rounds", []))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
