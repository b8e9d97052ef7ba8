"""Issue 43's GPU measurements in one command on one H100/H200, under 8 minutes: bf16 MFU of the compiled torch path
(llama3.2-1b, and llama3.1-8b with 4 of its 32 layers) beside `ember plan`'s prediction, FP8 (torchao rowwise and
tensorwise) against bf16 at the 8B shape, a torch.profiler breakdown of one compiled bf16 step per shape (GPU kernel
time by category, the idle gap, the top 15 kernels), and the XLA engine (jax on CUDA) against the compiled torch path:
`python3 benchmarks/gpu_suite.py --out $OUT` from the repository root (no install needed).

    python3 benchmarks/gpu_suite.py --out $OUT                      # everything, one GPU
    python3 benchmarks/gpu_suite.py --out $OUT --only fp8,profile   # a subset again
    python benchmarks/gpu_suite.py --dry-run --out /tmp/x           # this CPU: every part at the debug shape

Reuses single_device_mfu.measure() and its --suite shapes, single_device_mfu.planned() (`ember plan`), and
tpu_throughput.run_side() (an `ember train` subprocess per side). Each part has its own time budget (and the suite
a deadline) and its own try/except: a failure or an overrun is recorded as `error` in that part's file and the
suite goes on. Writes one file per part directly under --out: gpu_suite-<part>-<device kind>-<cuda|cpu>.json.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import re
import signal
import sys
import tempfile
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

BENCHMARKS = Path(__file__).resolve().parent
ROOT = BENCHMARKS.parent
# ember from this checkout without `pip install -e .`, here and in the `ember plan`/`ember train` subprocesses
sys.path[:0] = [str(ROOT), str(BENCHMARKS)]

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

import single_device_mfu as sdm  # noqa: E402
import tpu_throughput as tpu  # noqa: E402
from ember.metrics.profiling import exposed_time, without_kineto_notices  # noqa: E402
from results_file import write_results  # noqa: E402

PARTS = ("mfu", "profile", "fp8", "xla")  # run in this order: the most wanted figures first, should the deadline cut
# Estimates on an H200 from the previous runs: model build + compile ~40-90 s per compiled config (2 in mfu, 2 in
# fp8, whose bf16 baseline is mfu's), a few seconds of steps each; profile reuses mfu's compiled steps; xla is
# tpu_throughput's 86 s XLA side plus a compiled torch side (51 s cold, less with mfu's inductor cache warm).
ESTIMATE_S = {"mfu": 150, "profile": 5, "fp8": 170, "xla": 130}  # profile or fp8 without mfu: + mfu's bf16 runs
BUDGET_S = {"mfu": 210, "profile": 210, "fp8": 220, "xla": 170}  # caps; the suite's --deadline-s cuts them too
# A part with less than this left is skipped rather than cut (xla's XLA side alone took 86 s on an H200).
MIN_START_S = {"mfu": 60, "profile": 20, "fp8": 60, "xla": 100}
SUITE_DEADLINE_S = 460  # + ~10 s of imports before it starts: under 8 min, in a 15-minute lease that pays its start
FP8_SHAPE = "llama3.1-8b (4 of 32 layers)"
FP8_RECIPES = ("rowwise", "tensorwise")  # fp8.recipe values (ember/config.py FP8_RECIPES)
XLA_SHAPE = "llama3.2-1b"
STEP_RANGE = "gpu_suite/profiled_step"
DEVICE_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")  # chrome-trace categories of GPU work
HOST_EVENTS = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")  # host work: launches nest in ops
# Kernel (or CPU op) name -> category, first match wins: attention before GEMM (fmha_cutlass* kernels), optimizer
# and loss before the generic triton_/elementwise catch-all; rsqrt marks the fused RMSNorm kernels of inductor.
CATEGORY_RULES = (
    ("communication", ("nccl", "c10d::", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
                       "all_to_all", "alltoall", "record_param_comms", "gloo")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "scaled_dot_product")),
    ("optimizer", ("adam", "multi_tensor_apply", "_foreach_", "ember/optimizer")),
    ("loss", ("cross_entropy", "crossentropy", "nll_loss", "log_softmax", "logsumexp")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "ampere_", "aten::mm", "aten::addmm", "aten::bmm",
              "aten::baddbmm", "_scaled_mm", "_grouped_mm", "triton_tem_fused_mm", "triton_tem_fused_addmm")),
    ("norm", ("rsqrt", "rms_norm", "rmsnorm", "layer_norm")),
    ("elementwise/fused", ("triton_", "elementwise", "reduce_kernel", "aten::")),
)
CATEGORIES = tuple(name for name, _ in CATEGORY_RULES) + ("other",)
OP_CATEGORIES = ("communication", "attention", "optimizer", "loss", "norm")  # an op around a kernel may tell these


class PartTimeout(BaseException):
    """A part's budget ran out (SIGALRM); BaseException so a row's `except Exception` does not swallow it."""


def category(name: str) -> str:
    """gemm | attention | norm | elementwise/fused | optimizer | loss | communication | other, from a GPU kernel's
    name (or a CPU op's, on the dry run)."""
    lowered = name.lower()
    return next((cat for cat, keys in CATEGORY_RULES if any(key in lowered for key in keys)), "other")


def error_text(err: BaseException) -> str:
    """The error's first line, its message's tail (a subprocess's stderr ends with the cause) and where it was
    raised: enough to fix it without a GPU at hand."""
    text, frames = str(err), "".join(traceback.format_tb(err.__traceback__)[-3:])
    text = text if len(text) < 2500 else f"{text[:400]} ... {text[-2000:]}"
    return f"{type(err).__name__}: {text}\n{frames[-2000:]}"


def cleanup() -> None:
    """Between compiled models: without the dynamo reset the second shape's blocks (the same code object) are
    recompiled with sizes marked dynamic (automatic dynamic shapes), not the graph `ember train` compiles."""
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()  # peak_memory_gb is the allocator's high-water mark: per row


def shapes(dry: bool) -> dict[str, tuple[str, list[str]]]:
    """single_device_mfu's --suite shapes on a GPU; on the dry run the same names at the debug recipe's size."""
    if not dry:
        return dict(sdm.SUITE)
    tiny = ["compile=false", "global_batch_size=2", "micro_batch_size=2"]
    return {"llama3.2-1b": ("debug", tiny + ["model.remat=selective", "seq_len=64"]),  # xla runs its model.* too
            FP8_SHAPE: ("debug", tiny + ["model.n_layers=2", "seq_len=128"])}


def plan_device() -> Optional[str]:
    """`ember plan --device` for this machine (single_device_mfu.planned() alone would plan an H100)."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().upper()
    return next((dev for dev in ("h200", "h100", "b200", "a100", "mi300x") if dev.upper() in name), None)


def start_plans(pool: ThreadPoolExecutor, cfg: dict[str, Any]) -> dict[tuple, Future]:
    """Every prediction the suite shows, started now: `ember plan` is CPU work that overlaps the GPU's."""
    device = plan_device()
    wanted = [(recipe, (*over, "precision=bf16")) for recipe, over in cfg["shapes"].values()]
    recipe, over = cfg["shapes"][FP8_SHAPE]
    # not on the dry run: its fp8 is emulated (no plan to compare), and each plan is CPU time a 2-core box lacks
    wanted += [(recipe, (*over, "precision=fp8", f"fp8.recipe={r}")) for r in FP8_RECIPES if not cfg["dry"]]
    return {key: pool.submit(sdm.planned, key[0], [*key[1], "--device", device]) for key in wanted} if device else {}


def want_plan(cfg: dict[str, Any], row: dict[str, Any], recipe: str, overrides: list[str]) -> dict[str, Any]:
    """The row, to get its prediction from fill_plans(): measuring never waits for a plan."""
    row |= {"planned_step_time_s": None, "planned_mfu": None}
    if (recipe, tuple(overrides)) in cfg["plans"]:
        cfg["pending"].append((row, cfg["plans"][(recipe, tuple(overrides))]))
    return row


def fill_plans(cfg: dict[str, Any], wait_s: float) -> None:
    """The predictions of the rows measured so far, waiting at most wait_s in all (a late or failed plan leaves
    the row's plan columns empty)."""
    until = time.perf_counter() + wait_s
    for row, future in cfg["pending"]:
        try:
            plan = future.result(timeout=max(0.0, until - time.perf_counter()))
        except Exception:
            continue
        row |= {"planned_step_time_s": plan.get("step_time_s"), "planned_mfu": plan.get("mfu")}
        if row["planned_step_time_s"] and row.get("step_time_s"):
            row["step_over_plan"] = row["step_time_s"] / row["planned_step_time_s"]
    cfg["pending"] = [(row, future) for row, future in cfg["pending"] if not future.done()]


def ends(event: dict) -> float:
    return float(event["ts"]) + float(event["dur"])


def enclosing(events: list[dict]) -> dict[int, list]:
    """Host event index -> [names of the ranges and ops open around it, outermost first; its self time in us],
    from each thread's nesting in the chrome trace."""
    threads: dict[tuple, list[int]] = {}
    for i, e in enumerate(events):
        if e.get("ph") == "X" and e.get("cat") in HOST_EVENTS:
            threads.setdefault((e.get("pid"), e.get("tid")), []).append(i)
    found: dict[int, list] = {}
    for ids in threads.values():
        stack: list[int] = []
        for i in sorted(ids, key=lambda i: (float(events[i]["ts"]), -float(events[i]["dur"]))):
            while stack and ends(events[stack[-1]]) <= float(events[i]["ts"]):
                stack.pop()
            found[i] = [[events[j]["name"] for j in stack], float(events[i]["dur"])]
            if stack:
                found[stack[-1]][1] -= float(events[i]["dur"])
            stack.append(i)
    return found


def refined(name: str, around: list[str]) -> str:
    """A generic kernel's category from the op that launched it (an eager loss's exp/amax kernels are named
    elementwise; `_LinearCrossEntropySum` or `ember/optimizer` around them says what they are)."""
    own = category(name)
    if own not in ("elementwise/fused", "other"):
        return own
    return next((c for c in map(category, reversed(around)) if c in OP_CATEGORIES), own)


def breakdown(events: list[dict], cuda: bool) -> dict[str, Any]:
    """One profiled step from its chrome trace's events: time by category, the idle gap (the step's wall time
    during which no kernel ran; on CPU no op), and the top 15 names. On CUDA from the kernels, each categorised by
    its name or else by the ops around its launch; on CPU from the ops' self time."""
    step = next(e for e in events if e.get("name") == STEP_RANGE and e.get("cat") == "user_annotation")
    start, end = float(step["ts"]), ends(step)
    host = enclosing(events)
    launched = {events[i].get("args", {}).get("correlation"): around for i, (around, _) in host.items()
                if events[i].get("cat") in ("cuda_runtime", "cuda_driver")}  # kernel -> the ops around its launch
    totals: dict[tuple[str, str], list[float]] = {}  # (name, category) -> [microseconds, calls]
    spans = []
    for i, e in enumerate(events):
        if e.get("cat") not in (DEVICE_EVENTS if cuda else ("cpu_op",)) or "dur" not in e:
            continue
        a, b = max(start, float(e["ts"])), min(end, ends(e))
        if b <= a:
            continue
        spans.append((a, b))
        around, self_us = (launched.get(e.get("args", {}).get("correlation"), []), b - a) if cuda else host[i]
        entry = totals.setdefault((e["name"], refined(e["name"], around)), [0.0, 0])
        entry[0], entry[1] = entry[0] + self_us, entry[1] + 1
    idle_us = exposed_time([(start, end)], spans)  # the window's time not covered by any kernel/op
    by_category = dict.fromkeys(CATEGORIES, 0.0)
    for (_, cat), (us, _) in totals.items():
        by_category[cat] += us / 1e3
    work_ms = sum(by_category.values()) or 1.0
    top = sorted(totals.items(), key=lambda kv: -kv[1][0])[:15]
    return {"source": "CUDA kernels" if cuda else "CPU ops, self time (dry run: no kernels)",
            "profiled_step_ms": (end - start) / 1e3, "busy_ms": (end - start - idle_us) / 1e3,
            "idle_ms": idle_us / 1e3, "idle_share": idle_us / (end - start),
            "work_ms": work_ms, **{f"{cat}_ms": ms for cat, ms in by_category.items()},
            "top": [{"category": cat, "ms": us / 1e3, "calls": int(calls), "share_of_work": us / 1e3 / work_ms,
                     "name": name} for (name, cat), (us, calls) in top]}


def measure_profiled(recipe: str, overrides: list[str], steps: int, warmup: int, sink: dict) -> dict[str, Any]:
    """single_device_mfu.measure() whose last warm-up step runs under torch.profiler (its breakdown into `sink`):
    a step after warmup - 1 others, that measure() leaves out of the median, so the profiler's cost is not in it."""
    base = sdm.Trainer

    class ProfiledTrainer(base):  # measure() builds its Trainer by this module-level name
        def train_step(self, micro_batches: list) -> tuple[float, float]:
            self._suite_calls = getattr(self, "_suite_calls", 0) + 1
            if self._suite_calls != warmup:
                return super().train_step(micro_batches)
            cuda = self.device.type == "cuda"
            if cuda:
                torch.cuda.synchronize()
            prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
            try:  # a profiler that fails costs the profile part only, never the step or mfu's figure
                with without_kineto_notices():
                    prof.__enter__()
            except Exception as err:
                sink["error"] = error_text(err)
                return super().train_step(micro_batches)
            try:
                with record_function(STEP_RANGE):
                    result = super().train_step(micro_batches)
                    if cuda:  # the step's last kernels (the optimizer's) inside the window
                        torch.cuda.synchronize()
            finally:
                with without_kineto_notices():
                    prof.__exit__(None, None, None)
            try:
                with tempfile.TemporaryDirectory() as tmp:
                    prof.export_chrome_trace(str(Path(tmp) / "trace.json"))
                    sink.update(breakdown(json.loads((Path(tmp) / "trace.json").read_text())["traceEvents"], cuda))
            except Exception as err:
                sink["error"] = error_text(err)
            return result

    sdm.Trainer = ProfiledTrainer
    try:
        return sdm.measure(recipe, overrides, steps, warmup)
    finally:
        sdm.Trainer = base


def bf16_run(cfg: dict[str, Any], shape: str) -> dict[str, Any]:
    """One shape's compiled bf16 figure and profile, measured once per suite run (mfu, profile and fp8 share it)."""
    if shape not in cfg["bf16"]:
        recipe, overrides = cfg["shapes"][shape]
        overrides = overrides + ["precision=bf16"]
        cleanup()
        started, sink = time.perf_counter(), {}
        try:
            row = measure_profiled(recipe, overrides, cfg["steps"], cfg["warmup"], sink)
            row = want_plan(cfg, {"model": shape, **row}, recipe, overrides)
        except Exception as err:
            row = {"model": shape, "error": error_text(err)}
        row["wall_s"] = round(time.perf_counter() - started, 1)
        cfg["bf16"][shape], cfg["profiles"][shape] = row, sink
    return cfg["bf16"][shape]


# Each part appends its rows as they come (a part cut by its budget keeps what it measured) and returns the
# file's other fields.
def part_mfu(cfg: dict[str, Any], rows: list[dict]) -> dict[str, Any]:
    for shape in cfg["shapes"]:
        rows.append(bf16_run(cfg, shape))
    return {}


def part_profile(cfg: dict[str, Any], rows: list[dict]) -> dict[str, Any]:
    extra: dict[str, Any] = {"top_kernels": [], "categories": ", ".join(CATEGORIES),
                             "note": f"one step after {cfg['warmup'] - 1} warm-up steps, with the profiler on (its "
                                     f"wall time is profiled_step_ms; median_step_ms is the unprofiled steps')"}
    for shape in cfg["shapes"]:
        measured = bf16_run(cfg, shape)
        found = cfg["profiles"].get(shape) or {"error": measured.get("error", "no profiled step")}
        if "error" in found:
            rows.append({"model": shape, "error": found["error"]})
            continue
        fill_plans(cfg, 60)  # this part's rows show the plan beside the profile: worth a short wait
        median, planned = measured.get("step_time_s"), measured.get("planned_step_time_s")
        rows.append({"model": shape, "source": found["source"], "median_step_ms": median * 1e3 if median else None,
                     "planned_step_ms": planned * 1e3 if planned else None,
                     **{k: v for k, v in found.items() if k not in ("source", "top")}})
        extra["top_kernels"] += [{"model": shape, "rank": i + 1, **k} for i, k in enumerate(found["top"])]
    return extra


def fp8_unavailable() -> Optional[str]:
    if not torch.cuda.is_available():
        return "skipped: needs CUDA (sm89+) for FP8 matmuls; this run has no GPU"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return f"skipped: needs CUDA (sm89+); {torch.cuda.get_device_name()} is sm{major}{minor}"
    if importlib.util.find_spec("torchao") is None:
        return "skipped: torchao is not installed (pip install -e '.[fp8]' with this torch)"
    return None


def part_fp8(cfg: dict[str, Any], rows: list[dict]) -> dict[str, Any]:
    recipe, overrides = cfg["shapes"][FP8_SHAPE]
    source = "measured earlier in this run" if FP8_SHAPE in cfg["bf16"] else "measured in this part"
    bf16 = bf16_run(cfg, FP8_SHAPE)
    fill_plans(cfg, 30)  # the bf16 row is copied here: its plan first
    rows.append({"precision": "bf16", "fp8_recipe": "", **{k: v for k, v in bf16.items() if k != "losses"},
                 "source": source})
    why_not = fp8_unavailable()
    # The dry run also runs the emulated recipes (fp8.emulate=true) so the ratio's plumbing runs; not a speed.
    variants = [(r, []) for r in FP8_RECIPES] + [(r, ["fp8.emulate=true"]) for r in FP8_RECIPES if cfg["dry"]]
    for fp8_recipe, extra in variants:
        label = fp8_recipe + (" (emulated)" if extra else "")
        if why_not and not extra:
            rows.append({"model": FP8_SHAPE, "precision": "fp8", "fp8_recipe": label, "error": why_not})
            continue
        planned_as = overrides + ["precision=fp8", f"fp8.recipe={fp8_recipe}"]  # the key start_plans used
        cleanup()
        started = time.perf_counter()
        try:
            row = sdm.measure(recipe, planned_as + extra, cfg["steps"], cfg["warmup"])
            row = want_plan(cfg, {"model": FP8_SHAPE, "precision": "fp8", "fp8_recipe": label, **row}, recipe,
                            planned_as)
            row["ratio_to_bf16"] = row["tokens_per_s"] / bf16["tokens_per_s"] if "tokens_per_s" in bf16 else None
        except Exception as err:
            row = {"model": FP8_SHAPE, "precision": "fp8", "fp8_recipe": label, "error": error_text(err)}
        rows.append(row | {"wall_s": round(time.perf_counter() - started, 1)})
    return {"note": "mfu of an fp8 row is against the device's fp8 peak (twice bf16's)"}


def part_xla(cfg: dict[str, Any], rows: list[dict]) -> dict[str, Any]:
    """tpu_throughput --device gpu's XLA side (jax on CUDA) and compiled torch side, eager left out for time; the
    model overrides of mfu's 1B shape, so the torch side's compile finds mfu's graphs in inductor's cache."""
    missing = [p for p in ("jax", "torchax") if tpu.version(p) is None]
    if missing:
        raise RuntimeError(f"skipped: {' and '.join(missing)} not installed (pip install -e '.[tpu]' with jax[cuda])")
    cleanup()  # jax preallocates 75% of the GPU: this process keeps only its context
    extra = {"parent_reserved_gb": torch.cuda.memory_reserved() / 2**30 if torch.cuda.is_available() else 0.0}
    recipe, overrides = cfg["shapes"][XLA_SHAPE]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", JAX_PLATFORMS="cpu" if cfg["dry"] else "cuda")
    devices, kind = tpu.jax_devices(env)
    args = SimpleNamespace(batch=None, batch_per_device=2 if cfg["dry"] else 4, steps=6 if cfg["dry"] else 20,
                           logging_steps=2 if cfg["dry"] else 5, seq_len=64 if cfg["dry"] else 2048,
                           override=[o for o in overrides if o.startswith("model.")])
    common = tpu.train_overrides(args, devices) + ["precision=bf16"]
    torch_side = ["device=cpu", "compile=false"] if cfg["dry"] else ["device=cuda", "compile=true"]
    with tempfile.TemporaryDirectory() as scratch:
        for path, side, side_env in ((f"xla (jax {kind})", ["device=xla", f"ici_mesh.fsdp={devices}"], env),
                                     ("torch " + " ".join(torch_side), torch_side, dict(os.environ))):
            measured = tpu.run_side(recipe, [*common, *side], side_env, Path(scratch) / side[0].split("=")[1])
            rows.append({"shape": XLA_SHAPE, "path": path, **measured})
    rows[0]["ratio_xla_vs_torch"] = rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"]
    return extra


def on_alarm(signum: int, frame: Any) -> None:
    raise PartTimeout()


def run_part(part: str, cfg: dict[str, Any], args: argparse.Namespace, suite_start: float) -> dict[str, Any]:
    """One part under its budget: rows as far as it got, `error` when it failed or ran out of time; its file."""
    # the dry run's budgets are 3x: a busy 2-core CPU runs the debug shape slower than an H100 the real ones
    def left() -> float:
        return args.deadline_s - (time.perf_counter() - suite_start)

    budget = max(0.0, min(BUDGET_S[part] * (3 if cfg["dry"] else 1), left()))
    rows: list[dict[str, Any]] = []
    extra: dict[str, Any] = {}
    print(f"[{part}] starting: budget {budget:.0f} s, estimate {ESTIMATE_S[part]} s on an H200", flush=True)
    started = time.perf_counter()
    if budget < MIN_START_S[part]:
        extra["error"] = f"skipped: {budget:.0f} s left of the suite's {args.deadline_s:.0f} s deadline"
    else:
        signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, budget)
        try:
            extra = globals()[f"part_{part}"](cfg, rows)
        except PartTimeout:
            extra["error"] = f"ran past its budget of {budget:.0f} s"
        except (Exception, SystemExit) as err:  # tpu_throughput reports a failed side as SystemExit
            extra["error"] = error_text(err)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    fill_plans(cfg, min(60.0, max(0.0, left())))  # ready long since on a GPU host, where each takes seconds
    elapsed = time.perf_counter() - started
    versions = {p: tpu.version(p) for p in ("jax", "torchax", "torchao", "triton", "transformers")}
    extra |= {"elapsed_s": round(elapsed, 1), "budget_s": round(budget), "estimate_s": ESTIMATE_S[part],
              "dry_run": cfg["dry"]}
    path = write_results(f"gpu_suite-{part}-{cfg['kind']}", rows, args, **versions, **extra)
    print(f"[{part}] {'error' if 'error' in extra else 'done'} in {elapsed:.1f} s", flush=True)
    return {"part": part, "rows": rows, "path": path.name, **extra}


# The final table's columns per part (every figure is in the part's file).
SHOWN = {"mfu": ("model", "tokens_per_s", "mfu", "planned_mfu", "step_time_s", "planned_step_time_s", "memory_gb"),
         "profile": ("model", "profiled_step_ms", "idle_ms", *(f"{c}_ms" for c in CATEGORIES)),
         "fp8": ("model", "precision", "fp8_recipe", "tokens_per_s", "mfu", "ratio_to_bf16", "step_time_s"),
         "xla": ("path", "tokens_per_s", "mfu", "wall_s", "ratio_xla_vs_torch")}


def cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return "-" if value is None else str(value)[:30]


def print_table(results: list[dict[str, Any]], total: float) -> None:
    print(f"\n{'part':<9}{'status':<8}{'elapsed':>9}{'budget':>8}  file")
    for res in results:
        status = "error" if "error" in res else "ok"
        print(f"{res['part']:<9}{status:<8}{res['elapsed_s']:>8.1f}s{res['budget_s']:>7}s  {res['path']}")
    print(f"total {total:.1f} s")
    for res in results:
        unit = " (ms)" if res["part"] == "profile" else ""
        print(f"\n[{res['part']}]{unit}" + (f" error: {res['error'].splitlines()[0][:140]}" if "error" in res else ""))
        keys = SHOWN[res["part"]]
        lines = [[key.removesuffix("_ms") for key in keys]] + [[cell(r.get(key)) for key in keys] for r in res["rows"]]
        widths = [max(len(line[i]) for line in lines) for i in range(len(keys))]
        for line, r in zip(lines, [{}, *res["rows"]]):
            text = "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
            print(text + (f"  error: {r['error'].splitlines()[0][:100]}" if "error" in r else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the folder the part files go to")
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated, from {', '.join(PARTS)}")
    parser.add_argument("--dry-run", action="store_true", help="every part at the debug shape, compile=false (CPU)")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help=f"the whole suite's wall budget (default {SUITE_DEADLINE_S}, 3x that on --dry-run)")
    args = parser.parse_args()
    args.only = [p.strip() for p in args.only.split(",") if p.strip()]
    args.deadline_s = args.deadline_s or SUITE_DEADLINE_S * (3 if args.dry_run else 1)
    if not args.only or set(args.only) - set(PARTS):
        parser.error(f"--only {','.join(args.only)}: choose from {', '.join(PARTS)}")
    suite_start = time.perf_counter()
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    kind = ("dryrun" if args.dry_run else
            re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-") if torch.cuda.is_available()
            else "cpu")
    cfg: dict[str, Any] = {"dry": args.dry_run, "kind": kind, "shapes": shapes(args.dry_run), "bf16": {},
                           "profiles": {}, "steps": 2 if args.dry_run else 8, "warmup": 2 if args.dry_run else 4,
                           "pending": []}
    print(f"gpu_suite on {kind}: parts {', '.join(args.only)}; estimated {sum(ESTIMATE_S[p] for p in args.only)} s "
          f"on an H200 (profile or fp8 without mfu: + its 150 s), deadline {args.deadline_s:.0f} s", flush=True)
    with ThreadPoolExecutor(max_workers=2) as pool:
        cfg["plans"] = start_plans(pool, cfg)
        results = [run_part(part, cfg, args, suite_start) for part in PARTS if part in args.only]
    print_table(results, time.perf_counter() - suite_start)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
