"""Training tokens/s and MFU of the XLA path (device=xla|tpu: torchax + jax, ember/xla/) against the eager torch \
path on the same model, data and batch, both measured in one run of this script.

Each side is its own `python -m ember train RECIPE ... metrics.console=false` subprocess; its figures are the
median of the `tokens_per_s` and `mfu` of its metrics.jsonl windows, the first window left out (it holds the
XLA compile, and the eager side's warm-up). On CPU the XLA side runs on jax's CPU backend
(JAX_PLATFORMS=cpu, XLA_FLAGS=--xla_force_host_platform_device_count=N, ici_mesh.fsdp=N; N=1 by default, the
same single-device work as the eager side, which runs device=cpu). On a TPU there is no eager torch to
compare with: the eager side is skipped, and beside the measured figure the table shows `ember plan`'s
prediction for that TPU where the plan can produce one. On a GPU (`--device gpu`) the XLA side runs device=xla on
jax's CUDA backend, beside ember's torch path on the same GPU, eager and compiled, all in bf16.

    python benchmarks/tpu_throughput.py --device xla --shape debug            # on this CPU, a few minutes
    python benchmarks/tpu_throughput.py --device tpu --shape llama3.1-8b      # on a v5e/v6e host
    python benchmarks/tpu_throughput.py --device tpu --shape llama3.2-1b --steps 30 --batch-per-device 2
    python benchmarks/tpu_throughput.py --device gpu --shape llama3.2-1b      # one H100/H200, jax[cuda]
    python benchmarks/tpu_throughput.py --device gpu --shape llama3.2-1b --remat full,op,offload

The TPU figures are unmeasured until a TPU runs this script: benchmarks/results/ holds the CPU's and one
H200's (--device gpu). The target on a TPU is torchprime's MFU for Llama 3 8B on v6e-256 (the layout of the
recipe llama3-8b-v6e-256); torchprime's README lists that recipe without an MFU figure, so no number is quoted
here: compare with one torchprime publishes.

Writes benchmarks/results/tpu_throughput-<cpu|device kind>.json (e.g. -cpu, -tpu-v6-lite, -nvidia-h200): the
machine (the CPU model, or jax's device_kind), the date, torch/jax/torchax versions, every command run, and
the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

import torch

from ember.hardware import cpu_rates, peaks as hardware

ROOT = Path(__file__).resolve().parent.parent
# --shape -> the recipe whose model it is; the batch and sequence come from the command line (short runs).
SHAPES = {"debug": "debug", "llama3.2-1b": "llama3.2-1b", "llama3.1-8b": "llama3.1-8b"}
# On a TPU the large shapes run as torchprime's layouts do: every block recomputed, the blocks one scan.
TPU_MODEL_OVERRIDES = ["model.remat=full", "model.scan_layers=true"]
PLAN_DEVICES = {"TPU v5e": "tpu-v5e", "TPU v5p": "tpu-v5p", "TPU v6e": "tpu-v6e"}


def version(package: str) -> Optional[str]:
    """An installed package's version without importing it (torchax needs ember's shim to import)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def jax_devices(env: dict[str, str]) -> tuple[int, str]:
    """(device count, device_kind) of jax's default backend, asked in a subprocess: jax stays out of this one."""
    probe = "import jax; d = jax.devices(); print(len(d)); print(d[0].device_kind)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        wanted = env.get("JAX_PLATFORMS") or "default"
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"jax has no {wanted} devices here ({last}); --device gpu needs a GPU and jax[cuda], "
                         f"--device tpu a TPU host and jax[tpu]")
    count, kind = done.stdout.strip().splitlines()[-2:]
    return int(count), kind


def train_overrides(args: argparse.Namespace, devices: int) -> list[str]:
    """The run's length, batch and sequence, the same for both sides."""
    batch = args.batch if args.batch else args.batch_per_device * devices
    steps = ["max_steps=" + str(args.steps), f"logging_steps={args.logging_steps}",
             f"global_batch_size={batch}", f"micro_batch_size={batch // devices}", f"seq_len={args.seq_len}",
             "data.dataset=synthetic", "checkpoint.interval=0", "eval_interval=0", "resume=none", "seed=0"]
    return steps + list(args.override)


def run_side(recipe: str, overrides: list[str], env: dict[str, str], output_dir: Path) -> dict[str, Any]:
    """One `ember train` subprocess; its command, wall seconds and steady-state figures from metrics.jsonl."""
    command = [sys.executable, "-m", "ember", "train", recipe, *overrides, "metrics.console=false",
               f"output_dir={output_dir}"]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    seconds = time.perf_counter() - start
    shown = " ".join(command[1:]).replace(str(output_dir), "OUT")
    if done.returncode != 0:
        raise SystemExit(f"`{shown}` failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    windows = [r for r in records if "tokens_per_s" in r]
    steady = windows[1:]  # the first window holds the compile (XLA) or the warm-up (eager)
    if not steady:
        raise SystemExit(f"`{shown}` logged {len(windows)} window(s): raise --steps above --logging-steps x 2")
    mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
    memory = [r["memory_gb"] for r in windows if r.get("memory_gb") is not None]
    return {"command": shown, "wall_s": round(seconds, 1), "steps": windows[-1]["step"],
            "windows_used": len(steady), "first_window_tokens_per_s": windows[0]["tokens_per_s"],
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
            "mfu": statistics.median(mfus) if mfus else None,
            "memory_gb": max(memory) if memory else None,  # the device's peak on TPUs/GPUs (host RSS on CPU)
            "losses": [r["loss"] for r in records if "loss" in r and "tokens_per_s" in r]}


def plan_prediction(recipe: str, overrides: list[str], world: int, device_kind: str) -> dict[str, Any]:
    """`ember plan`'s tokens/s and MFU for this TPU and layout, or why there is none (never fatal)."""
    spec = hardware.tpu_spec(device_kind)
    plan_device = PLAN_DEVICES.get(spec.name) if spec else None
    if plan_device is None:
        return {"plan": "no plan for this device"}
    command = [sys.executable, "-m", "ember", "plan", recipe, "--world", str(world), "--device", plan_device,
               *[o for o in overrides if not o.startswith(("resume=", "device="))], "--json"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
        plan = json.loads(done.stdout) if done.returncode == 0 else None
    except (subprocess.TimeoutExpired, json.JSONDecodeError):
        plan = None
    if not plan or not plan.get("step_time_s"):
        return {"plan": "no plan for this device", "plan_command": " ".join(command[1:])}
    batch = int(_value(overrides, "global_batch_size")) * int(_value(overrides, "seq_len"))
    return {"plan_command": " ".join(command[1:]), "plan_fits": plan.get("fits"),
            "plan_tokens_per_s": batch / plan["step_time_s"], "plan_mfu": plan.get("mfu")}


def _value(overrides: list[str], key: str) -> str:
    return [o.split("=", 1)[1] for o in overrides if o.startswith(key + "=")][-1]


def measure_shape(shape: str, args: argparse.Namespace, scratch: Path) -> list[dict[str, Any]]:
    """The rows of one shape: the XLA side, and the eager side (CPU) or the plan's prediction (TPU)."""
    recipe = SHAPES[shape]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    if args.device == "xla":
        env |= {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.xla_devices}"}
        devices, kind = args.xla_devices, cpu_rates.cpu_model()
    else:
        env |= {"JAX_PLATFORMS": "cuda"} if args.device == "gpu" else {}
        devices, kind = jax_devices(env)
    common = train_overrides(args, devices) + (["precision=bf16"] if args.device == "gpu" else [])
    model = TPU_MODEL_OVERRIDES if args.device == "tpu" and shape != "debug" else []
    xla = run_side(recipe, [*common, *model, "device=" + ("tpu" if args.device == "tpu" else "xla"),
                            f"ici_mesh.fsdp={devices}"], env, scratch / f"{shape}-xla")
    rows = [{"shape": shape, "path": f"xla ({args.device}, {devices} device(s))", "device_kind": kind, **xla}]
    if args.device in ("xla", "gpu"):  # ember's torch path on the same device, one process, the same batch
        torch_device = "cpu" if args.device == "xla" else "cuda"
        for compiled in ([False] if args.device == "xla" else [False, True]):
            name = f"{'compiled' if compiled else 'eager'} torch ({torch_device})"
            side = run_side(recipe, [*common, f"device={torch_device}", f"compile={str(compiled).lower()}"],
                            dict(os.environ, TOKENIZERS_PARALLELISM="false"),
                            scratch / f"{shape}-{name.split()[0]}")
            rows.append({"shape": shape, "path": name, "device_kind": kind, **side})
        rows[0]["ratio_xla_vs_eager"] = xla["tokens_per_s"] / rows[1]["tokens_per_s"]
        if len(rows) > 2:
            rows[0]["ratio_xla_vs_compiled"] = xla["tokens_per_s"] / rows[2]["tokens_per_s"]
    else:
        rows[0] |= plan_prediction(recipe, [*common, *model, f"ici_mesh.fsdp={devices}"], devices, kind)
    return rows


def measure_remat(shape: str, args: argparse.Namespace, scratch: Path) -> list[dict[str, Any]]:
    """The XLA side once per --remat policy, the blocks one scan (as the TPU recipes run them): tokens/s, the
    device's peak memory and the logged losses, which the policies must leave equal (they only choose what
    the backward recomputes or fetches from host memory)."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    env |= {"JAX_PLATFORMS": "cuda"} if args.device == "gpu" else {}
    devices, kind = jax_devices(env)
    common = train_overrides(args, devices) + (["precision=bf16"] if args.device == "gpu" else [])
    rows = []
    for policy in args.remat:
        side = run_side(SHAPES[shape], [*common, f"model.remat={policy}", "model.scan_layers=true",
                                        "device=" + ("tpu" if args.device == "tpu" else "xla"),
                                        f"ici_mesh.fsdp={devices}"], env, scratch / f"{shape}-{policy}")
        rows.append({"shape": shape, "path": f"xla ({args.device}, {devices} device(s))",
                     "device_kind": kind, "remat": policy, **side})
    for row in rows:
        row["ratio_vs_first_policy"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
        row["max_loss_difference_vs_first_policy"] = max(abs(a - b) for a, b in zip(row["losses"], rows[0]["losses"]))
    return rows


def print_remat_table(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'shape':<14}{'remat':<10}{'tok/s':>12}{'MFU':>8}{'vs first':>10}{'peak GiB':>10}{'max |dloss|':>13}")
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
        memory = f"{r['memory_gb']:.2f}" if r.get("memory_gb") is not None else "-"
        print(f"{r['shape']:<14}{r['remat']:<10}{r['tokens_per_s']:>12,.0f}{mfu:>8}{r['ratio_vs_first_policy']:>9.2f}x"
              f"{memory:>10}{r['max_loss_difference_vs_first_policy']:>13.2e}")


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'shape':<14}{'path':<30}{'tok/s':>12}{'MFU':>8}{'XLA/eager':>11}{'plan tok/s':>12}{'plan MFU':>10}")
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
        ratio = f"{r['ratio_xla_vs_eager']:.2f}x" if "ratio_xla_vs_eager" in r else ""
        plan_tps = f"{r['plan_tokens_per_s']:,.0f}" if "plan_tokens_per_s" in r else ""
        plan_mfu = f"{r['plan_mfu']:.1%}" if r.get("plan_mfu") is not None else ""
        print(f"{r['shape']:<14}{r['path']:<30}{r['tokens_per_s']:>12,.0f}{mfu:>8}{ratio:>11}{plan_tps:>12}{plan_mfu:>10}")
        if "ratio_xla_vs_compiled" in r:
            print(f"{'':<14}XLA / compiled torch: {r['ratio_xla_vs_compiled']:.2f}x")
        if r.get("plan") == "no plan for this device":
            print(f"{'':<14}no plan for this device")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("xla", "tpu", "gpu"), default="xla",
                        help="xla: jax's CPU backend against eager torch on the CPU; tpu: the TPU host's chips; "
                             "gpu: jax's CUDA backend against ember's torch path on the same GPU")
    parser.add_argument("--shape", default="debug",
                        help=f"comma-separated, from {', '.join(SHAPES)} (the large ones need a TPU)")
    parser.add_argument("--xla-devices", type=int, default=1, help="jax CPU devices on --device xla (ici_mesh.fsdp)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--logging-steps", type=int, default=10)
    parser.add_argument("--seq-len", type=int, default=None, help="default: 256 for debug, 8192 on a TPU")
    parser.add_argument("--batch", type=int, default=None, help="global batch (default: --batch-per-device x devices)")
    parser.add_argument("--batch-per-device", type=int, default=None, help="default: 8 on CPU, 1 on a TPU")
    parser.add_argument("--override", action="append", default=[], help="an extra key=value for both sides")
    parser.add_argument("--remat", default=None,
                        help="comma-separated model.remat policies (none, full, op, offload) to run the XLA side "
                             "with instead, the blocks one scan: tokens/s, device peak memory and losses per policy "
                             "(--device gpu|tpu; writes tpu_throughput-remat-<device>.json)")
    parser.add_argument("--notes", default="", help="a note stored with the results")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    shapes = [s.strip() for s in args.shape.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown or (args.device == "xla" and any(s != "debug" for s in shapes)):
        parser.error(f"--shape {args.shape}: choose from {', '.join(SHAPES)}; only debug runs on --device xla (CPU)")
    large = shapes != ["debug"]
    args.seq_len = args.seq_len or {"tpu": 8192 if large else 256, "gpu": 2048 if large else 256}.get(args.device, 256)
    args.batch_per_device = args.batch_per_device or {"xla": 8, "gpu": 4}.get(args.device, 1)
    if args.remat is not None:
        args.remat = [p.strip() for p in args.remat.split(",") if p.strip()]
        wrong = [p for p in args.remat if p not in ("none", "full", "op", "offload")]
        if wrong or not args.remat:
            parser.error(f"--remat: '{','.join(wrong)}' is not a policy; choose from none, full, op, offload")
        if args.device == "xla":
            parser.error("--remat needs --device gpu or tpu: jax's CPU compiler keeps offloaded activations on the "
                         "device, so the policies' memory would not differ")

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        for shape in shapes:
            rows += (measure_remat if args.remat else measure_shape)(shape, args, Path(scratch))
    (print_remat_table if args.remat else print_table)(rows)

    kind = rows[0]["device_kind"]
    machine = (f"{kind}, {torch.get_num_threads()} torch threads" if args.device == "xla"
               else f"{rows[0]['path']}: {kind}")
    slug = "cpu" if args.device == "xla" else re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-")
    result = {"benchmark": "tpu_throughput", "date": date.today().isoformat(), "machine": machine,
              "torch": torch.__version__, "jax": version("jax"), "torchax": version("torchax"),
              "config": vars(args) | {"out": str(args.out)}, "commands": [r["command"] for r in rows], "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"tpu_throughput-{'remat-' if args.remat else ''}{slug}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
