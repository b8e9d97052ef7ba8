"""ember's XLA engine (device=xla: torchax + jax) against MaxText, the two XLA trainers a TPU user chooses between,
on the same jax devices: the same Llama shape, global batch, sequence, dtype, AdamW and clipping, blocks as one
scan with full remat, random tokens, timed side by side in one run of this script.

On this CPU the devices are jax's CPU backend, one device or eight virtual ones
(XLA_FLAGS=--xla_force_host_platform_device_count=8), at three layouts: 1 device, fsdp=8, fsdp=4 x tensor=2.
Each side is its own subprocess, alternating ember and MaxText for --rounds rounds. A run's figure is the mean
of its steady steps' seconds (their sum over their count), the first --warmup steps left out (they hold the
compile): ember's from its metrics.jsonl windows, MaxText's from its `completed step: N, seconds: S` lines.
MaxText times a step from its dispatch to the next one's, with one step queued behind the running one, so its
single steps alternate short and long while their sum is the run's time; a median of them would not be. A
row's figure is the median of its runs'. `ratio` is MaxText's step time over ember's: above 1, ember is faster.
Each row also holds `ember plan --device cpu`'s step priced from the compiled program (plan.json's xla_step), and
its error against the measured one (plan_error).

--profile adds one profiled run of each side per row (jax.profiler on both, two steady steps) and sums its trace
by XLA op kind in busy thread-ms per device and step (benchmarks/xla_trace.py): the matmuls (XLA:CPU's YNNPACK
fusions and dots), each collective, the copies and transposes, the other fusions, and the ms a step no device
thread ran an op: where two equal programs differ, this says which ops take the difference.

MaxText runs in its own environment (it needs Python >= 3.12 and a newer jax than ember's torchax pins). Set it
up from the repository root:

    python3.12 -m venv .venv-maxtext && .venv-maxtext/bin/pip install -r benchmarks/requirements-maxtext.txt

    python benchmarks/maxtext_peer.py         # debug shape, fp32, every layout; or:
    python benchmarks/maxtext_peer.py --shape debug,100m --precision fp32,bf16 --rounds 2
    python benchmarks/maxtext_peer.py --layout fsdp8 --dump-hlo /tmp/hlo   # both sides' compiled HLO, to compare
    python benchmarks/maxtext_peer.py --replan   # the stored rows priced again by this checkout's planner

--ember-python runs ember's side in another environment (a Python 3.12 one with MaxText's jax release puts both
sides on the same XLA); --tag TAG writes maxtext_peer-TAG-cpu.json. The results go to maxtext_peer-cpu.json in
--out (default benchmarks/results, the committed figures) after each row: the CPU, the date, both sides' jax
versions, every command, and per row both sides' step times and first losses (a fresh model on random tokens
starts about 0.5 above ln(vocab) on both sides).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict
from datetime import date
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).parent))  # benchmarks/ is a folder of scripts: its modules by file name
import xla_trace  # noqa: E402
from maxtext_commands import (  # noqa: E402
    LAYOUTS,
    PRECISIONS,
    SHAPES,
    Shape,
    device_env,
    ember_command,
    ember_steps,
    maxtext_command,
    maxtext_steps,
)
from maxtext_env import (  # noqa: E402
    ROOT,
    base_yml,
    check_writable,
    earlier_rows,
    ember_versions,
    find_maxtext_python,
    maxtext_versions,
    results_path,
)


def steady_seconds(steps: list[tuple[int, float, float]], warmup: int) -> list[float]:
    """The seconds of the steps after the first `warmup` (MaxText counts steps from 0, ember's windows end at
    their last step, from 1)."""
    return [seconds for step, seconds, _ in steps if step > warmup]


def run(command: list[str], env: dict[str, str], shown: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"`{shown}` failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    return done.stdout + done.stderr


def measure_ember(shape: Shape, layout: str, precision: str, args: argparse.Namespace,
                  scratch: Path) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix=f"ember-{layout}-{precision}-", dir=scratch))  # each run its own folder
    command = ember_command(shape, layout, precision, args.logging_steps, out, args.ember_python)
    shown = " ".join(command[2:]).replace(str(out), "OUT")
    run(command, device_env(LAYOUTS[layout][0], _dump(args, "ember", layout, precision)), shown)
    if not (out / "metrics.jsonl").is_file():
        raise SystemExit(f"`{shown}` ended without writing its metrics.jsonl: is {args.ember_python} ember's?")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = ember_steps(records, shape.batch * shape.seq_len)
    return {"command": shown, "steps": steps, "seconds": steady_seconds(steps, args.warmup)}


def measure_maxtext(shape: Shape, layout: str, precision: str, args: argparse.Namespace,
                    scratch: Path) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix=f"maxtext-{layout}-{precision}-", dir=scratch))
    command = maxtext_command(args.maxtext_python, shape, layout, precision, out)
    shown = " ".join(["python", *command[1:]]).replace(str(out), "OUT")
    command[command.index("BASE_YML")] = args.base_yml
    log = run(command, device_env(LAYOUTS[layout][0], _dump(args, "maxtext", layout, precision)), shown)
    steps = maxtext_steps(log)
    if len(steps) != shape.steps:
        raise SystemExit(f"`{shown}` logged {len(steps)} of {shape.steps} steps:\n{log[-3000:]}")
    return {"command": shown, "steps": steps, "seconds": steady_seconds(steps, args.warmup - 1)}


def planned_step(shape: Shape, layout: str, precision: str, args: argparse.Namespace, scratch: Path) -> dict:
    """What `ember plan ... --device cpu` predicts of ember's run of the row: plan.json's xla_step."""
    train = ember_command(shape, layout, precision, args.logging_steps, scratch / "plan", args.ember_python)
    command = [*train[:3], "plan", *train[4:], "--world", str(LAYOUTS[layout][0]), "--device", "cpu", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, env=device_env(LAYOUTS[layout][0]), cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"`ember plan` of the {layout} row failed (exit {done.returncode}): "
                           f"{(done.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(done.stdout)["xla_step"]


PROFILED_STEPS = 2


def profile_side(side: str, shape: Shape, layout: str, precision: str, args: argparse.Namespace,
                 scratch: Path) -> dict[str, Any]:
    """One run of `side` with jax.profiler tracing PROFILED_STEPS steps after --warmup, summed by op kind
    (xla_trace.summarize)."""
    out = scratch / f"profile-{side}-{layout}-{precision}"
    first = args.warmup + 1  # 1-based: the first steady step
    steps = dataclasses.replace(shape, steps=first + PROFILED_STEPS + 1)
    if side == "ember":
        command = ember_command(steps, layout, precision, args.logging_steps, out, args.ember_python) + [
            "profile.enabled=true", f"profile.step={first}", f"profile.steps={PROFILED_STEPS}"]
    else:
        command = maxtext_command(args.maxtext_python, steps, layout, precision, out) + [
            "profiler=xplane", f"skip_first_n_steps_for_profiler={first - 1}", f"profiler_steps={PROFILED_STEPS}"]
        command[command.index("BASE_YML")] = args.base_yml
    devices = LAYOUTS[layout][0]
    run(command, device_env(devices), f"{side} --profile")
    return xla_trace.summarize(xla_trace.find_trace(out), devices, PROFILED_STEPS)


def _dump(args: argparse.Namespace, side: str, layout: str, precision: str) -> Optional[Path]:
    return args.dump_hlo / f"{side}-{layout}-{precision}" if args.dump_hlo else None


def measure_row(shape_name: str, layout: str, precision: str, args: argparse.Namespace,
                scratch: Path) -> dict[str, Any]:
    """Both sides, alternating, --rounds times; the median of each side's per-round means."""
    shape = replace_steps(SHAPES[shape_name], args)
    sides: dict[str, list[dict[str, Any]]] = {"ember": [], "maxtext": []}
    for _ in range(args.rounds):
        sides["ember"].append(measure_ember(shape, layout, precision, args, scratch))
        sides["maxtext"].append(measure_maxtext(shape, layout, precision, args, scratch))
    row: dict[str, Any] = {"shape": shape_name, "precision": precision, "layout": layout, "steps": shape.steps,
                           "rounds": args.rounds}
    for side, runs in sides.items():
        means = [statistics.fmean(r["seconds"]) for r in runs if r["seconds"]]
        if not means:
            raise SystemExit(f"{side} kept no step after --warmup {args.warmup}: raise --steps")
        row[f"{side}_step_s"] = statistics.median(means)
        row[f"{side}_tokens_per_s"] = shape.batch * shape.seq_len / row[f"{side}_step_s"]
        row[f"{side}_round_step_s"] = means
        row[f"{side}_kept_step_s"] = [r["seconds"] for r in runs]
        row[f"{side}_first_loss"] = runs[0]["steps"][0][2]
        row[f"{side}_command"] = runs[0]["command"]
    row["ratio"] = row["maxtext_step_s"] / row["ember_step_s"]
    store_plan(row, shape, args, scratch)
    row.update(args.ember, ember_python=args.ember_python_shown)
    if args.profile:
        row["profile_ms_per_device_step"] = {
            side: profile_side(side, shape, layout, precision, args, scratch) for side in ("ember", "maxtext")}
    return row


def store_plan(row: dict[str, Any], shape: Shape, args: argparse.Namespace, scratch: Path) -> None:
    """The row's planned step and its parts, and plan_error against its measured step; a failing plan is said and
    stored (plan_failed), the row's measurements kept."""
    row.update(ember_planned_step_s=None, plan_error=None)
    row.pop("plan_failed", None)
    try:
        planned = planned_step(shape, row["layout"], row["precision"], args, scratch)
        row["ember_planned_parts_s"] = {part: planned[f"{part}_s"] for part in ("matmul", "memory", "collective")}
        row["ember_planned_step_s"] = planned["step_s"]
        row["plan_error"] = planned["step_s"] / row["ember_step_s"] - 1
    except RuntimeError as err:
        row["plan_failed"] = str(err)
        print(f"warning: {err}", file=sys.stderr)


def replan(args: argparse.Namespace) -> int:
    """--replan: the results file's rows priced again by this checkout's `ember plan`, their measured steps kept;
    refused where the file's figures were measured on another CPU or by another ember environment."""
    from ember.hardware import cpu_rates

    path = results_path(args)
    result = json.loads(path.read_text()) if earlier_rows(path, args, "--replan") else {}  # checked, then read
    rows = result.get("rows", [])
    machine = f"{cpu_rates.cpu_model()}, {os.cpu_count()} cores"
    if not rows or result.get("machine") != machine:
        raise SystemExit(f"--replan: {path} holds no rows measured on this machine ({machine}): measure them first")
    print(f"pricing {len(rows)} rows of {path} with `ember plan` (about half a minute each)")
    with tempfile.TemporaryDirectory() as scratch:
        for row in rows:
            store_plan(row, dataclasses.replace(SHAPES[row["shape"]], steps=row["steps"]), args, Path(scratch))
            print_table([row])
    result["replanned"] = date.today().isoformat()
    path.write_text(json.dumps(result, indent=2) + "\n")
    print_table(rows)
    print(f"wrote {path}")
    return 0


def replace_steps(shape: Shape, args: argparse.Namespace) -> Shape:
    return dataclasses.replace(shape, steps=args.steps or shape.steps)


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'shape':<7}{'precision':<10}{'layout':<15}{'ember s/step':>13}{'MaxText s/step':>15}{'ratio':>8}"
          f"{'planned s/step':>16}{'plan error':>11}")
    for r in rows:
        planned = (f"{r['ember_planned_step_s']:>16.3f}{r['plan_error']:>+11.1%}" if r["plan_error"] is not None
                   else f"{'failed':>16}{'':>11}")
        print(f"{r['shape']:<7}{r['precision']:<10}{r['layout']:<15}{r['ember_step_s']:>13.3f}"
              f"{r['maxtext_step_s']:>15.3f}{r['ratio']:>7.2f}x{planned}")


PER_ROW = ("shape", "layout", "precision", "rounds", "steps", "profile", "merge")


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """The command line as the results file keeps it: paths inside the repository relative to it, MaxText's own
    config file (found in its environment) left out."""
    config = {}
    for key, value in vars(args).items():
        if key in ("base_yml", "ember", "ember_python_shown"):
            continue
        if key == "ember_python":
            value = args.ember_python_shown
        if isinstance(value, Path):
            value = str(value.relative_to(ROOT)) if value.is_absolute() and value.is_relative_to(ROOT) else str(value)
        config[key] = value
    return config


def parse_list(text: str, known: dict[str, Any] | tuple[str, ...], flag: str,
               parser: argparse.ArgumentParser) -> list[str]:
    chosen = [item.strip() for item in text.split(",") if item.strip()]
    wrong = [item for item in chosen if item not in known]
    if wrong or not chosen:
        named = f"unknown {', '.join(wrong)}" if wrong else "names none"
        parser.error(f"{flag} {text}: {named}; choose from {', '.join(known)}")
    return chosen


MIN_KEPT_STEPS = 3  # MaxText's first steady steps run long (its one-step queue filling): one alone misleads


def write_results(rows: list[dict[str, Any]], args: argparse.Namespace) -> Path:
    """benchmarks/results/maxtext_peer-cpu.json (--out: the folder) with the rows so far; with --merge, the file's
    rows of other (shape, precision, layout) kept, and the header's per-row settings left to the rows."""
    from ember.hardware import cpu_rates

    result = {"benchmark": "maxtext_peer", "date": date.today().isoformat(),
              "machine": f"{cpu_rates.cpu_model()}, {os.cpu_count()} cores", **args.ember,
              **maxtext_versions(args.maxtext_python), "config": run_config(args), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    path = results_path(args)
    if args.merge:
        measured = {(r["shape"], r["precision"], r["layout"]) for r in rows}
        earlier = earlier_rows(path, args)
        result["rows"] = [r for r in earlier if (r["shape"], r["precision"], r["layout"]) not in measured] + rows
        for key in PER_ROW:  # each row says its own; the header's would be the last part's only
            result["config"].pop(key, None)
    result["shapes"] = {name: {k: v for k, v in asdict(SHAPES[name]).items() if k != "steps"}
                        for name in sorted({r["shape"] for r in result["rows"]})}
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="debug", help=f"comma-separated, from {', '.join(SHAPES)} "
                        "(default: %(default)s)")
    parser.add_argument("--layout", default=",".join(LAYOUTS), help=f"comma-separated, from {', '.join(LAYOUTS)} "
                        "(default: all)")
    parser.add_argument("--precision", default="fp32", help="comma-separated, from fp32, bf16 (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side per row, alternating "
                        "(default: %(default)s)")
    parser.add_argument("--steps", type=int, default=None, help="steps a run, warm-up included (default: the "
                        f"shape's: 20 for debug, 6 for 100m); at least --warmup + {MIN_KEPT_STEPS}")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing, the compile "
                        "(default: %(default)s)")
    parser.add_argument("--maxtext-python", default=None, help="default: $EMBER_MAXTEXT_PYTHON, else "
                        ".venv-maxtext/bin/python")
    parser.add_argument("--ember-python", default=None, help="the interpreter ember's side runs in, an "
                        "environment with ember's tpu extra (default: this one); a Python 3.12 one with MaxText's jax "
                        "puts both sides on the same jax release")
    parser.add_argument("--tag", default="", help="writes maxtext_peer-TAG-cpu.json (a set of figures kept apart: "
                        "another --ember-python's, say)")
    parser.add_argument("--dump-hlo", type=Path, default=None, help="write both sides' compiled HLO under this "
                        "folder (XLA_FLAGS=--xla_dump_to), one subfolder per side and row; the train programs are "
                        "ember's *jit_train.* and MaxText's *jit_train_step.* files")
    parser.add_argument("--profile", action="store_true", help="one profiled run of each side per row: the "
                        "trace's busy thread-ms per device and step by XLA op kind, and the ms a step no device "
                        "thread ran an op (in the results file, each row's profile_ms_per_device_step)")
    parser.add_argument("--merge", action="store_true", help="keep the results file's rows of other shapes, "
                        "precisions and layouts (a long matrix measured in parts)")
    parser.add_argument("--notes", default="", help="a note stored with the results")
    parser.add_argument("--replan", action="store_true", help="price the results file's rows again with this "
                        "checkout's `ember plan`, their measurements kept (after a planner change; same CPU)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results",
                        help="the folder of maxtext_peer-cpu.json (default: benchmarks/results, the committed "
                        "figures: a trial run belongs elsewhere)")
    args = parser.parse_args(argv)
    shapes = parse_list(args.shape, SHAPES, "--shape", parser)
    layouts = parse_list(args.layout, LAYOUTS, "--layout", parser)
    precisions = parse_list(args.precision, tuple(PRECISIONS), "--precision", parser)
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps {args.steps}: give a positive number of steps a run")
    if args.rounds < 1 or args.warmup < 1:
        parser.error("--rounds and --warmup must be at least 1 (the first step holds the compile)")
    for shape in shapes:
        steps = args.steps or SHAPES[shape].steps
        if steps - args.warmup < MIN_KEPT_STEPS:
            parser.error(f"--steps {steps} keeps {max(steps - args.warmup, 0)} step(s) after --warmup "
                         f"{args.warmup}; give --steps of at least {args.warmup + MIN_KEPT_STEPS}")
    args.logging_steps = 1
    args.out = args.out.resolve()  # the children run in the repository root
    args.dump_hlo = args.dump_hlo.resolve() if args.dump_hlo else None
    if args.tag and not (len(args.tag) <= 64 and re.fullmatch(r"[a-z0-9]+([.-][a-z0-9]+)*", args.tag)):
        parser.error(f"--tag {args.tag}: up to 64 lowercase letters and digits, words joined by dots or dashes "
                     "(it names the results file)")
    # everything a row needs is checked before the first run: the interpreters, the results file and its folder
    args.ember_python, args.ember_python_shown, args.ember = ember_versions(args.ember_python, sys.executable)
    if args.replan:
        return replan(args)
    args.maxtext_python = find_maxtext_python(args.maxtext_python, dict(os.environ))
    args.base_yml = base_yml(args.maxtext_python)
    check_writable(results_path(args), args)
    print(f"ember: {args.ember_python} (Python {args.ember['ember_python_version']}, jax {args.ember['ember_jax']}); "
          f"MaxText: {args.maxtext_python}; results: {results_path(args)}")

    rows: list[dict[str, Any]] = []
    path = results_path(args)
    try:
        with tempfile.TemporaryDirectory() as scratch:
            for shape in shapes:
                for precision in precisions:
                    for layout in layouts:
                        rows.append(measure_row(shape, layout, precision, args, Path(scratch)))
                        print_table(rows[-1:])
                        path = write_results(rows, args)  # a later failure or Ctrl-C keeps this row
    except KeyboardInterrupt:
        kept = f"; the {len(rows)} row(s) measured are in {path}" if rows else ""
        print(f"interrupted{kept}", file=sys.stderr)
        return 130
    print_table(rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
