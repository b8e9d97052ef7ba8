"""`ember plan RECIPE [key=value ...] --world N ...`: its arguments, the table, plan.json (the plan itself:
ember/plan)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.table import Table

from ember.config import XLA_DEVICES
from ember.errors import ConfigError
from ember.metrics.run_metrics import plural
from ember.plan.cost import FABRICS
from ember.plan.planner import Plan, make_plan
from ember.storage.location import Location, as_path, check_reachable
from ember.usage import ArgumentParser

DESCRIPTION = """Plan a training job before booking the cluster: on this CPU, in one process, build each rank's
share of the model with ember's own parallelize pipeline over a fake process group (every rank of any
world size), track one training step's memory under fake tensors, and estimate the step time.
Prints per rank: parameter, gradient and optimizer bytes (the real shards), activations and the peak;
the step time, MFU and collective volumes per mesh axis; whether it fits, the largest micro-batch that does,
and layout warnings. Writes plan.json (the recipe's output_dir, or --output); --json prints it instead (and
writes it only to --output)."""

PLAN_KEYS = {"world_size", "device", "fits", "ranks"}  # what every plan.json holds

EXAMPLES = """examples:
  ember plan llama3.1-405b --world 1024 ici_mesh.tensor=8 ici_mesh.fsdp=1 dcn_mesh.fsdp=16 dcn_mesh.data=8 \
model.remat=full
  ember plan mixtral-8x7b --world 64 --device h200 ici_mesh.expert=8 ici_mesh.fsdp=1 dcn_mesh.fsdp=8 --search
  ember plan debug --world 2 --device cpu ici_mesh.fsdp=2 micro_batch_size=4 --json"""


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="ember plan", description=DESCRIPTION, epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", metavar="RECIPE", help="a built-in recipe (see `ember recipes`) or a YAML path")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as for `ember train`")
    p.add_argument("--world", type=int, required=True, metavar="N", help="the number of devices (ranks)")
    p.add_argument("--nodes", type=int, default=None, metavar="M",
                   help="nodes the ranks are spread over (default: the device's per-node count, 8 GPUs)")
    p.add_argument("--device", default="h100", choices=[*FABRICS, "cpu"],
                   help="the device type (default: h100): compute and memory from ember/hardware/peaks.py, links from "
                   "ember/plan/cost.py")
    p.add_argument("--search", action="store_true",
                   help="try the remat policies and micro-batch sizes; list the feasible ones by predicted tokens/s")
    p.add_argument("--json", action="store_true", help="print plan.json to stdout instead of the table (no file is "
                   "written unless --output is given)")
    p.add_argument("--output", metavar="FILE", default=None, help="where plan.json goes "
                   "(default: OUTPUT_DIR/plan.json; with --json, only where --output says)")
    return p


def parse(argv: list[str]) -> argparse.Namespace:
    args = parser().parse_intermixed_args(argv)  # flags anywhere among the key=value overrides
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        raise ConfigError(f"'{bad[0]}' is not a key=value override (flags go before or after them: --world N ...)")
    if args.world < 1:
        raise ConfigError(f"--world must be a positive number of devices, got {args.world}")
    return args


def run(args: argparse.Namespace) -> int:
    """Plan, print, write."""

    from ember.train import run as run_lib
    cfg = run_lib.load_config(args.recipe, args.overrides, world_size=args.world)
    # --json prints plan.json instead of the table and writes no file, unless --output names one
    path = as_path(args.output) if args.output else None if args.json else as_path(cfg.output_dir) / "plan.json"
    if path is not None:  # a local path or a URL (s3://, gs://: its bucket and credentials checked now)
        check_reachable(path, "--output" if args.output else "output_dir", must_exist=False)
        _check_replaceable(path)  # before the planning: a file of the user's is never overwritten
    plan = make_plan(cfg, args.world, args.nodes, args.device, args.search)
    if cfg.device in XLA_DEVICES:  # beside the model above: the XLA path's own compiled step, on virtual CPU devices
        from ember.xla.plan import compiled_step_on_virtual_devices

        print(f"compiling the XLA step on {plural(args.world, 'virtual CPU device')} and pricing it"
              + (" (each of its matmuls timed here)" if args.device == "cpu" else ""), file=sys.stderr, flush=True)
        start = time.perf_counter()
        compiled = compiled_step_on_virtual_devices(cfg, args.world, args.device)
        plan.seconds += time.perf_counter() - start
        plan.xla_memory, plan.xla_step = compiled["memory"], compiled.get("step")
        if "step_unpriced" in compiled:
            plan.warnings.append(f"XLA path step: {compiled['step_unpriced']}")
    text = json.dumps(plan.to_json(), indent=1) + "\n"
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if args.json:
        print(text, end="")
    else:
        render(plan, Console(soft_wrap=True), path)
    return 0


def _duration(seconds: float) -> str:
    """Three significant digits, in ms under a second (an accelerator's step of a small model is a few ms)."""
    return f"{seconds:.3f} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


def _check_replaceable(path: Location) -> None:
    """An existing `path` is replaced only when it is a plan.json (an earlier plan); any other file is refused,
    as `ember eval --output` refuses a file that is not an eval.json."""
    if not path.exists():
        return
    try:
        previous = json.loads(path.read_text())
    except (OSError, ValueError):
        previous = None
    if not isinstance(previous, dict) or not PLAN_KEYS <= previous.keys():
        raise ConfigError(f"{path} exists and is not a plan.json ember wrote; move it aside or pass another --output")


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f}"


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return str(ranks[0])
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks)) if len(ranks) <= 4 else f"{ranks[0]}, {ranks[1]}, ... ({len(ranks)} ranks)"


def render(plan: Plan, console: Console, path: Optional[Path]) -> None:
    """The per-role memory table, the step, the traffic, the verdict and the warnings."""
    title = (f"ember plan: {plan.mesh} on {plan.world_size} x {plan.device} ({plural(plan.nodes, 'node')}), "
             f"micro-batch {plan.micro_batch_size}, remat={plan.remat}, {plan.precision} matmuls at "
             f"{plan.peak_flops / 1e12:,.4g} TFLOP/s peak")
    table = Table(title=title, title_justify="left", min_width=100)
    for column in ("ranks", "stage", "params GiB", "grads GiB", "optim GiB", "activations GiB", "peak GiB"):
        table.add_column(column, justify="left" if column in ("ranks", "stage") else "right")
    by_rank = {r.rank: r for r in plan.ranks}
    for role in plan.roles:
        groups: dict[tuple, list[int]] = {}  # ranks of the role that hold the same bytes (uneven shards differ)
        for rank in role.ranks:
            r = by_rank[rank]
            numbers = (r.param_bytes, r.grad_bytes, r.optim_bytes, r.activation_bytes, r.peak_bytes)
            groups.setdefault(numbers, []).append(rank)
        layers = plural(role.n_layers, "layer")
        stage = role.kind if len(plan.roles) == 1 else f"{role.kind}, pp {role.pp_rank}, {layers}"
        for numbers, ranks in groups.items():
            table.add_row(_ranks(ranks), stage, *(_gib(n) for n in numbers))
    table.caption = ("peak: the state and activations, plus what lives only during the step (gathered weights, "
                     "unsharded gradients, logits, temporaries)")
    table.caption_justify = "left"
    console.print(table)
    if any("expert" in r.coordinate for r in plan.ranks):
        console.print("expert ranks: each holds n_experts / expert of the experts (the same bytes where the rows "
                      "above do not differ)")
    s = plan.step
    console.print(f"step: {s.flops:.3e} model FLOPs, compute {s.compute_s:.2f} s, overlapped communication "
                  f"{s.overlapped_s:.2f} s, exposed {s.exposed_s:.2f} s, bubble {s.bubble:.0%} -> "
                  f"[bold]{s.step_s:.2f} s/step, {s.tokens_per_s:,.0f} tokens/s, MFU {s.mfu:.1%}[/bold]")
    traffic = Table(title="collectives per step, per rank", title_justify="left")
    for column in ("group", "ranks", "GB sent", "link", "seconds", "overlapped"):
        traffic.add_column(column, justify="left" if column in ("group", "link") else "right")
    for t in plan.traffic:
        traffic.add_row(" x ".join(t.axes), str(t.size), f"{t.bytes / 1e9:,.1f}",
                        "inter-node" if t.crosses_nodes else "intra-node", f"{t.seconds:.2f}",
                        "yes" if t.overlapped else "no")
    if plan.traffic:
        console.print(traffic)
    peak = max(r.peak_bytes for r in plan.ranks)
    if plan.xla_memory is not None:
        x = plan.xla_memory
        console.print(f"XLA path (device=tpu|xla): the compiled step per device, XLA's memory analysis on "
                      f"{plural(plan.world_size, 'virtual CPU device')}: weights, optimizer state and batch "
                      f"{_gib(x['arguments'])} GiB, temporaries {_gib(x['temporaries'])} GiB -> peak "
                      f"{_gib(x['peak'])} GiB. The CPU compiler's: it counts SDPA's full score matrix where a TPU "
                      "runs the flash kernel, and remat outside a layer scan saves it nothing; the verdict below "
                      "is the model's above")
    if plan.xla_step is not None:
        x = plan.xla_step
        console.print(f"XLA path step, priced op by op from the compiled program: {_duration(x['step_s'])} (matmuls "
                      f"{_duration(x['matmul_s'])}, other ops {_duration(x['memory_s'])}, collectives "
                      f"{_duration(x['collective_s'])}; {x['priced_by']})")
    verdict = "[green]fits[/green]" if plan.fits else "[red]does not fit[/red]"
    best = (f"; the largest micro-batch that fits: {plan.max_micro_batch}" if plan.max_micro_batch
            else "; no micro-batch fits")
    if plan.max_micro_batch and plan.max_micro_batch == plan.micro_batch_limit:  # memory did not set the limit
        best += " (the most global_batch_size allows per data-parallel rank)"
    console.print(f"verdict: {verdict}: peak {_gib(peak)} GiB of {_gib(plan.usable_bytes)} GiB usable{best}")
    for note in plan.warnings:
        console.print(f"[yellow]warning:[/yellow] {note}")
    if plan.options:
        options = Table(title="feasible (remat, micro-batch) by predicted tokens/s", title_justify="left")
        for column in ("remat", "micro-batch", "peak GiB", "s/step", "tokens/s", "MFU"):
            options.add_column(column, justify="left" if column == "remat" else "right")
        for o in plan.options:
            options.add_row(o["remat"], str(o["micro_batch_size"]), _gib(o["peak_bytes"]), f"{o['step_time_s']:.2f}",
                            f"{o['tokens_per_s']:,.0f}", f"{o['mfu']:.1%}")
        console.print(options)
    elif plan.searched:
        console.print("--search: no (remat, micro-batch) fits")
    if path is not None:
        console.print(f"planned in {plan.seconds:.1f} s; wrote {path}")
