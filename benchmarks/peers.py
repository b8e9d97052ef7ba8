"""Training tokens/s and peak memory: ember beside litgpt and torchtitan, the same Llama trained by each
framework's own trainer in a fresh process, with the same batch, AdamW settings, clipping and precision.

    python benchmarks/peers.py                                      # debug, 56m, 128k; fp32, bf16; eager + compiled
    python benchmarks/peers.py --shapes tiny --rounds 1 --steps 6 --warmup 2
    python benchmarks/peers.py --shapes debug --modes eager --frameworks ember,torchtitan --device cuda

ember runs `ember train debug` with overrides; litgpt its pretraining entry (`litgpt.pretrain.setup`, what
`litgpt pretrain` calls, which always torch.compiles: it has no eager row); torchtitan its trainer
(`torchtitan.train.main`, ConfigManager and all) with a few run-time changes that get it running on a CPU,
listed in the output (benchmarks/peers_runners/). The peers run in their own environment, never ember's:

    python -m venv .venv-peers && .venv-peers/bin/pip install torch==2.13.0 \\
        && .venv-peers/bin/pip install torch==2.13.0 -r benchmarks/requirements-peers.txt

Each framework's step time is its own: ember's `step_time_s` in metrics.jsonl (data wait included), litgpt's
logged `iter time` (forward, backward, clipping, optimizer step and a loss sync; not the data fetch),
torchtitan's logged tps (the time between two log lines: all of a step; tps is printed as an integer).
The first `--warmup` steps are dropped (compiled runs: `--warmup-compiled`), the median of the rest gives
tokens/s; each round is a fresh process per framework, the order rotated each round, the figure per framework
the median over rounds. `ember/this` is ember's tokens/s over the row's. Train RSS is the child's peak resident
memory (VmHWM) once it has logged all but its last step: the memory training needs, without what a framework
does after it (ember's final evaluation and checkpoint, litgpt's checkpoint); peak RSS is the whole process's
ru_maxrss. Compile workers a child starts are in neither. The parameter counts each framework prints must agree.
Run it on an otherwise idle machine: on a small CPU another busy process slows the small ops of a step many
times over (torch's threads wait for each other), and not every framework alike.

Writes benchmarks/results/peers-<device>.json (--out: another folder), with ember's version and commit and the
warnings printed on the way; a row whose kept step times vary over 1.5x in a round is marked noisy (`"noisy":
true` and its `step_spread`, in the table and the summary too). Ctrl-C (exit 130) or SIGTERM (exit 143) writes
the rows finished so far there, marked `"interrupted": true`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import torch

sys.path.insert(0, str(Path(__file__).parent))
from results_file import write_results  # noqa: E402

from ember.config import load as load_config  # noqa: E402
from ember.device import cpu_runs_bf16_natively  # noqa: E402
from ember.errors import ConfigError, EmberError  # noqa: E402
from ember.models.llama.args import FLAVORS, LlamaArgs  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RUNNERS = Path(__file__).resolve().parent / "peers_runners"
FRAMEWORKS = ("ember", "litgpt", "torchtitan")
# The mode each peer's users get by default: what eager ember is held against in the summary.
DEFAULT_MODE = {"litgpt": "compiled", "torchtitan": "eager"}
LITGPT_EAGER = "n/a (litgpt pretrain always compiles)"
# A round whose kept step times (slowest over fastest) vary more than this is noisy: warned of, its row marked.
NOISY_SPREAD = 1.5
NOTES = ("step times are each framework's own: ember's step_time_s (data wait included), litgpt's iter time "
         "(no data fetch), torchtitan's tps (all of a step); litgpt's pretraining always compiles")
SETUP = ("python -m venv .venv-peers && .venv-peers/bin/pip install torch==2.13.0 && "
         ".venv-peers/bin/pip install torch==2.13.0 -r benchmarks/requirements-peers.txt")


class Shape(NamedTuple):
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab: int
    batch: int
    seq: int


# debug: ember's llama3 debug flavor at the debug recipe's batch; 56m: a wider, deeper trunk with Llama 2's
# vocabulary (56.4M parameters); 128k: the debug trunk under Llama 3's vocabulary (the head dominates).
SHAPES = {
    "tiny": Shape(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, vocab=512, batch=2, seq=64),
    "debug": Shape(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab=8192, batch=8, seq=256),
    "56m": Shape(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab=32000, batch=8, seq=512),
    "128k": Shape(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab=128256, batch=8, seq=256),
}


def model_args(shape: Shape) -> LlamaArgs:
    """ember's llama3 debug flavor at `shape`: its FFN rule (multiple_of 64), RoPE theta and norm eps."""
    return dataclasses.replace(FLAVORS["llama3"]["debug"], dim=shape.dim, n_layers=shape.n_layers,
                               n_heads=shape.n_heads, n_kv_heads=shape.n_kv_heads, vocab_size=shape.vocab)


def find_peers_python(given: Optional[str], environ: dict[str, str], repo: Path = REPO) -> Path:
    """--peers-python, else $EMBER_PEERS_PYTHON, else the repository's .venv-peers/bin/python."""
    chosen = given or environ.get("EMBER_PEERS_PYTHON") or str(repo / ".venv-peers" / "bin" / "python")
    path = Path(chosen)
    if not path.is_file():
        raise ConfigError(f"no peers environment: {path} does not exist; set one up with `{SETUP}` (or point "
                          "--peers-python or EMBER_PEERS_PYTHON at a python that has litgpt and torchtitan)")
    return path


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


def parse_ember_metrics(text: str) -> list[float]:
    """Per-step times from ember's metrics.jsonl (logging_steps=1: one training record per step)."""
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [r["step_time_s"] for r in sorted((r for r in records if "step_time_s" in r), key=lambda r: r["step"])]


LITGPT_ITER = re.compile(r"\| iter (\d+) step \d+ \|.*\| iter time: ([\d.]+) ms")
LITGPT_PARAMS = re.compile(r"^Total parameters: ([\d,]+)", re.M)
TITAN_STEP = re.compile(r"step:\s*(\d+)\s+loss:.*\stps: ([\d,]+)")
TITAN_PARAMS = re.compile(r"size: ([\d,]+) total parameters")


def parse_litgpt_log(text: str) -> tuple[list[float], Optional[int]]:
    """(per-iteration seconds from litgpt's `iter time: X ms` lines, its `Total parameters` count)."""
    times = [float(ms) / 1000 for _, ms in LITGPT_ITER.findall(text)]
    params = LITGPT_PARAMS.search(text)
    return times, int(params.group(1).replace(",", "")) if params else None


def parse_torchtitan_log(text: str, tokens_per_step: int) -> tuple[list[float], Optional[int]]:
    """(per-step seconds, tokens per step / its logged tps, and torchtitan's `size: N total parameters`)."""
    # tps is printed rounded: a 0 (a step over 2 x tokens_per_step seconds) reads as the most it can be, 0.5
    times = [tokens_per_step / (int(tps.replace(",", "")) or 0.5) for _, tps in TITAN_STEP.findall(text)]
    params = TITAN_PARAMS.search(text)
    return times, int(params.group(1).replace(",", "")) if params else None


def tagged(text: str, kind: str) -> list[str]:
    """The runners' `PEERS <kind> ...` lines, in order, each once."""
    found = [line.split(" ", 2)[2] for line in text.splitlines() if line.startswith(f"PEERS {kind} ")]
    return list(dict.fromkeys(found))


def vm_hwm_kib(pid: int) -> Optional[int]:
    """A live process's peak resident memory so far (VmHWM in /proc/PID/status, KiB); None where unreadable."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    found = re.search(r"^VmHWM:\s+(\d+) kB", status, re.M)
    return int(found.group(1)) if found else None


def run_child(cmd: list[str], log: Path, timeout_s: float, steps_done: Optional[Callable[[str], int]] = None,
              train_steps: int = 0) -> tuple[int, int, str, Optional[int]]:
    """(exit code, the child's own peak RSS in KiB, its output, its peak RSS in KiB once `steps_done(output)`
    first reaches `train_steps`: the training steps' memory, without what a framework does after them, such as
    ember's final evaluation and checkpoint). A child still running after `timeout_s` is killed (exit code -9).

    wait4's ru_maxrss also counts the launching process's own peak (Linux carries the memory high-water mark
    of the forked copy across exec), so it is the child's peak only where it exceeds this process's peak at
    launch; otherwise the child's VmHWM, polled while it runs, is reported."""
    launcher_kib = vm_hwm_kib(os.getpid()) or 0
    polled_kib = 0
    with log.open("w") as sink:
        # its own process group, so that stopping it also stops what it started (compile workers)
        child = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                 env=os.environ | {"PYTHONUNBUFFERED": "1"})
        deadline, train_kib = time.monotonic() + timeout_s, None
        try:
            while True:
                pid, status, usage = os.wait4(child.pid, os.WNOHANG)
                if pid:
                    break
                polled_kib = max(polled_kib, vm_hwm_kib(child.pid) or 0)
                if time.monotonic() > deadline:
                    os.killpg(child.pid, signal.SIGKILL)
                if steps_done is not None and train_kib is None:
                    if steps_done(log.read_text(errors="replace")) >= train_steps:
                        train_kib = vm_hwm_kib(child.pid)
                time.sleep(0.02)
        except BaseException:  # Ctrl-C, SIGTERM (main's handler raises Stopped): the child goes too
            os.killpg(child.pid, signal.SIGKILL)
            os.waitpid(child.pid, 0)
            raise
        child.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    peak_kib = usage.ru_maxrss if usage.ru_maxrss > launcher_kib else polled_kib
    return child.returncode, peak_kib, log.read_text(errors="replace"), train_kib


def command(framework: str, shape: Shape, precision: str, mode: str, args: argparse.Namespace,
            out: Path, peers_python: Optional[Path]) -> list[str]:
    """The child's command line: `ember train debug` with overrides, or a peer's runner script."""
    cfg = load_config("debug", [])
    optim = cfg.optim
    if framework == "ember":
        return [sys.executable, "-m", "ember", "train", "debug", f"model.dim={shape.dim}",
                f"model.n_layers={shape.n_layers}", f"model.n_heads={shape.n_heads}",
                f"model.n_kv_heads={shape.n_kv_heads}", f"model.vocab_size={shape.vocab}",
                f"global_batch_size={shape.batch}", f"micro_batch_size={shape.batch}", f"seq_len={shape.seq}",
                "data.dataset=synthetic", f"max_steps={args.steps}", "logging_steps=1", "schedule.name=constant",
                "schedule.warmup_steps=0", "checkpoint.interval=0", "eval_interval=0", "metrics.console=false",
                "metrics.tensorboard=false", f"compile={mode == 'compiled'}", f"precision={precision}",
                f"device={args.device}", "resume=none", f"output_dir={out}"]
    llama = model_args(shape)
    return [str(peers_python), str(RUNNERS / f"{framework}_run.py"), "--dim", str(shape.dim),
            "--n-layers", str(shape.n_layers), "--n-heads", str(shape.n_heads), "--n-kv-heads", str(shape.n_kv_heads),
            "--vocab", str(shape.vocab), "--ffn-hidden", str(llama.ffn_hidden_dim), "--batch", str(shape.batch),
            "--seq", str(shape.seq), "--steps", str(args.steps), "--rope-theta", str(llama.rope_theta),
            "--norm-eps", str(llama.norm_eps), "--lr", str(optim.lr), "--weight-decay", str(optim.weight_decay),
            "--betas", *(str(b) for b in optim.betas), "--eps", str(optim.eps),
            "--max-norm", str(optim.max_grad_norm), "--precision", precision, "--mode", mode,
            "--device", args.device, "--out", str(out)]


def measure(framework: str, shape_name: str, precision: str, mode: str, args: argparse.Namespace,
            peers_python: Optional[Path]) -> dict[str, Any]:
    """One fresh-process run: {status, step_times_s, params, peak_rss_kib, ...} or {status: failed, reason}."""
    shape = SHAPES[shape_name]
    with tempfile.TemporaryDirectory(prefix=f"peers-{framework}-") as tmp:
        out = Path(tmp) / "run"
        cmd = command(framework, shape, precision, mode, args, out, peers_python)
        print(f"  {framework:<11} {shape_name} {precision} {mode} ...", flush=True)
        metrics = out / "metrics.jsonl"
        tokens = shape.batch * shape.seq
        # training steps logged so far: ember's in its metrics.jsonl (its console is off), the peers' in their output
        counters = {"ember": lambda _: len(parse_ember_metrics(metrics.read_text())) if metrics.is_file() else 0,
                    "litgpt": lambda text: len(parse_litgpt_log(text)[0]),
                    "torchtitan": lambda text: len(parse_torchtitan_log(text, tokens)[0])}
        code, rss_kib, text, train_kib = run_child(cmd, Path(tmp) / "output.log", args.timeout,
                                                   counters[framework], args.steps - 1)
        if framework == "ember":
            times = parse_ember_metrics(metrics.read_text()) if metrics.is_file() else []
            run_json = out / "run.json"
            params = json.loads(run_json.read_text())["params"] if run_json.is_file() else None
        elif framework == "litgpt":
            times, params = parse_litgpt_log(text)
        else:
            times, params = parse_torchtitan_log(text, shape.batch * shape.seq)
    warmup = args.warmup_compiled if mode == "compiled" else args.warmup
    result = {"params": params, "peak_rss_kib": rss_kib, "train_rss_kib": train_kib, "step_times_s": times,
              "patches": tagged(text, "patch"), "versions": tagged(text, "version")}
    reason = (f"killed (SIGKILL: the {args.timeout:.0f} s --timeout, or out of memory)" if code == -9
              else f"exit code {code}" if code != 0
              else f"{len(times)} step times in its output, not more than the {warmup} warmup" if len(times) <= warmup
              else "no parameter count in its output" if params is None else None)
    if reason is None:
        step = steady_step_time(times, warmup)
        kept = times[warmup:]
        spread = max(kept) / min(kept)
        noisy = spread > NOISY_SPREAD  # still warming up, recompiling, or a busy machine
        warning = (f"{framework}'s kept step times vary {spread:.1f}x ({min(kept) * 1e3:.0f}-"
                   f"{max(kept) * 1e3:.0f} ms): raise --steps/--warmup, or idle the machine") if noisy else None
        if warning:
            print(f"  warning: {warning}", flush=True)
        return result | {"status": "ok", "step_s": step, "tokens_per_s": shape.batch * shape.seq / step,
                         "step_spread": spread, "noisy": noisy, "warning": warning}
    tail = text.strip().splitlines()[-30:]
    print(f"  {framework} failed ({reason}): {' '.join(cmd)}\n" + ("\n".join(tail) or "(no output)"),
          file=sys.stderr, flush=True)
    return result | {"status": "failed", "reason": reason + (f": {tail[-1][:200]}" if tail else ", no output")}


def summarize(shape: str, precision: str, mode: str, framework: str, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """A table row: the median over the rounds that ran (tokens/s, step, peak RSS) and every round's raw times."""
    ok = [r for r in rounds if r["status"] == "ok"]
    row: dict[str, Any] = {"shape": shape, "precision": precision, "mode": mode, "framework": framework,
                           "status": "ok" if ok else "failed", "tokens_per_s": None, "step_ms": None,
                           "train_rss_mib": None, "peak_rss_mib": None, "ember_ratio": None, "noisy": None,
                           "step_spread": None, "params": next((r["params"] for r in rounds if r["params"]), None),
                           "reason": "; ".join(f"round {i + 1}: {r['reason']}" for i, r in enumerate(rounds)
                                               if r["status"] != "ok") or None}
    if ok:
        tokens_per_s = statistics.median(r["tokens_per_s"] for r in ok)
        row |= {"tokens_per_s": tokens_per_s, "step_ms": SHAPES[shape].batch * SHAPES[shape].seq / tokens_per_s * 1e3,
                "peak_rss_mib": statistics.median(r["peak_rss_kib"] for r in ok) / 1024}
        train = [r["train_rss_kib"] for r in ok if r.get("train_rss_kib")]
        row["train_rss_mib"] = statistics.median(train) / 1024 if train else None
        # the widest round: one noisy round is enough to doubt the median, as its warning said
        row |= {"noisy": any(r["noisy"] for r in ok), "step_spread": max(r["step_spread"] for r in ok)}
    row["rounds"] = [{k: r.get(k) for k in ("status", "tokens_per_s", "train_rss_kib", "peak_rss_kib", "step_times_s")}
                     for r in rounds]
    return row


def not_run(shape: str, precision: str, mode: str, framework: str, status: str, reason: str) -> dict[str, Any]:
    return {"shape": shape, "precision": precision, "mode": mode, "framework": framework, "status": status,
            "tokens_per_s": None, "step_ms": None, "train_rss_mib": None, "peak_rss_mib": None, "ember_ratio": None,
            "noisy": None, "step_spread": None, "params": None, "reason": reason}


def run_group(shape: str, precision: str, mode: str, args: argparse.Namespace, peers_python: Optional[Path],
              bf16_skip: Optional[str], counts: dict[str, int]) -> tuple[list[dict[str, Any]], list[str]]:
    """One (shape, precision, mode)'s rows, and the `PEERS` lines its runs printed (torchtitan's patches, the
    peers' versions) with the warnings printed about them (`warning TEXT`). Each round starts every framework
    afresh, the order rotated each round so that drift of the machine does not favour one; `counts`
    (framework -> parameters, this shape's) must stay equal."""
    rows, runnable, tags = [], [], []
    for framework in args.frameworks:
        if precision == "bf16" and bf16_skip:
            rows.append(not_run(shape, precision, mode, framework, "skipped", bf16_skip))
        elif framework == "litgpt" and mode == "eager":
            rows.append(not_run(shape, precision, mode, framework, "n/a", LITGPT_EAGER))
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
    return rows + [summarize(shape, precision, mode, framework, rounds[framework]) for framework in runnable], tags


def run_all(args: argparse.Namespace, peers_python: Optional[Path], bf16_skip: Optional[str],
            rows: list[dict[str, Any]], tags: list[str]) -> None:
    """Every (shape, precision, mode, framework) row, appended to `rows` as its group finishes, and the `PEERS`
    lines and warnings of its runs to `tags`: what a Ctrl-C leaves there has finished."""
    counts: dict[str, dict[str, int]] = {}
    for shape in args.shapes:
        for precision in args.precisions:
            for mode in args.modes:
                group, printed = run_group(shape, precision, mode, args, peers_python, bf16_skip,
                                           counts.setdefault(shape, {}))
                rows += group
                tags += printed


def add_ember_ratios(rows: list[dict[str, Any]]) -> None:
    """Each peer row's `ember_ratio`: ember's tokens/s over the row's, where both ran."""
    by_key = {(r["shape"], r["precision"], r["mode"], r["framework"]): r for r in rows}
    for row in rows:
        ember = by_key.get((row["shape"], row["precision"], row["mode"], "ember"))
        if row["framework"] != "ember" and row["tokens_per_s"] and ember and ember["tokens_per_s"]:
            row["ember_ratio"] = ember["tokens_per_s"] / row["tokens_per_s"]


def tagged_as(tags: list[str], kind: str) -> list[str]:
    """The texts of run_all's `kind` tags (`patch`, `version`, `warning`), in order, each once."""
    return list(dict.fromkeys(t.split(" ", 1)[1] for t in tags if t.startswith(f"{kind} ")))


def peer_versions(tags: list[str], frameworks: list[str], peers_python: Optional[Path]) -> dict[str, str]:
    """{"litgpt": "0.5.13", ...}: each peer's version as its runs printed it, else (no run of it printed one:
    litgpt's rows are all eager, say) as the peers' environment's package metadata gives it."""
    versions = dict(text.split(" ", 1) for text in tagged_as(tags, "version"))
    for peer in frameworks:
        if peer in versions or peer == "ember" or peers_python is None:
            continue
        probe = f"from importlib.metadata import version; print(version({peer!r}))"  # as litgpt_run.py says it
        try:
            found = subprocess.run([str(peers_python), "-c", probe], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            continue  # no version is better than a wrong one; the rows are worth more than it
        if found.returncode == 0 and found.stdout.strip():
            versions[peer] = found.stdout.strip()
    return versions


def summary_pairs(rows: list[dict[str, Any]]) -> list[tuple[dict[str, Any], list[tuple[dict[str, Any], str]]]]:
    """(ember's measured row, [(each measured peer row it is held against, that row's mode)]) per (shape,
    precision, mode) where ember and a peer both ran: eager ember against each peer's default mode (litgpt
    compiled, torchtitan eager), compiled ember against the compiled peers."""
    by_key = {(r["shape"], r["precision"], r["mode"], r["framework"]): r for r in rows if r["tokens_per_s"]}
    pairs = []
    for (shape, precision, mode, framework), ember in by_key.items():
        if framework != "ember":
            continue
        peers = [(by_key[key], key[2]) for peer in DEFAULT_MODE
                 if (key := (shape, precision, DEFAULT_MODE[peer] if mode == "eager" else "compiled", peer)) in by_key]
        if peers:
            pairs.append((ember, peers))
    return pairs


def summary_heading(rows: list[dict[str, Any]]) -> str:
    """The summary's first line: for each mode of ember that was held against a peer, the peers (and their
    modes) it was held against, and nothing about a mode or a peer that did not run."""
    pairs = summary_pairs(rows)
    eager = {peer["framework"] for ember, peers in pairs if ember["mode"] == "eager" for peer, _ in peers}
    compiled = {peer["framework"] for ember, peers in pairs if ember["mode"] == "compiled" for peer, _ in peers}
    parts = []
    if eager:
        ran = [f"{peer} {mode}" for peer, mode in DEFAULT_MODE.items() if peer in eager]
        defaults = "their defaults" if len(ran) > 1 else "its default"
        parts.append(f"eager ember against {' and '.join(ran)}, {defaults}")
    if compiled:
        parts.append(f"compiled ember against compiled {' and '.join(p for p in DEFAULT_MODE if p in compiled)}")
    return f"ember vs fastest peer ({'; '.join(parts)}):" if parts else "ember vs fastest peer:"


def summary_lines(rows: list[dict[str, Any]]) -> list[str]:
    """`ember vs fastest peer` per (shape, precision, mode) (see summary_pairs), a noisy side's step-time spread
    after it, and the training RSS beside the lowest peer's."""
    lines = []
    for ember, peers in summary_pairs(rows):
        shape, precision, mode = ember["shape"], ember["precision"], ember["mode"]
        fastest, peer_mode = max(peers, key=lambda p: p[0]["tokens_per_s"])
        # a noisy median is said where the figure is read, not only in the warnings above the table
        noisy = [f"{r['framework']} step times vary {r['step_spread']:.1f}x" for r in (ember, fastest) if r["noisy"]]
        lines.append(f"{shape} {precision} {mode}: ember {ember['tokens_per_s']:,.0f} tok/s vs fastest peer "
                     f"{fastest['framework']} ({peer_mode}) {fastest['tokens_per_s']:,.0f} tok/s: "
                     f"{ember['tokens_per_s'] / fastest['tokens_per_s']:.2f}x"
                     + (f" (noisy: {', '.join(noisy)})" if noisy else ""))
        memories = [(p["train_rss_mib"], p["framework"]) for p, _ in peers if p["train_rss_mib"]]
        if memories and ember["train_rss_mib"]:
            lowest, name = min(memories)
            lines.append(f"{shape} {precision} {mode}: training RSS ember {ember['train_rss_mib']:,.0f} MiB vs "
                         f"lowest peer {name} {lowest:,.0f} MiB: {ember['train_rss_mib'] / lowest:.2f}x")
    return lines


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'shape':<7}{'precision':<10}{'mode':<10}{'framework':<12}{'params':>12}{'tokens/s':>11}"
          f"{'step ms':>10}{'train RSS MiB':>15}{'peak RSS MiB':>14}{'ember/this':>12}")
    for r in rows:
        head = f"{r['shape']:<7}{r['precision']:<10}{r['mode']:<10}{r['framework']:<12}"
        if r["tokens_per_s"] is None:
            print(f"{head}{r['status']}: {r['reason']}")
            continue
        ratio = f"{r['ember_ratio']:.2f}x" if r["ember_ratio"] else ""
        train = f"{r['train_rss_mib']:,.0f}" if r["train_rss_mib"] else "n/a"
        print(f"{head}{r['params']:>12,}{r['tokens_per_s']:>11,.0f}{r['step_ms']:>10.1f}{train:>15}{r['peak_rss_mib']:>14,.0f}"
              f"{ratio:>12}" + (f"  ({r['reason']})" if r["reason"] else "")
              + (f"  (noisy: step times vary {r['step_spread']:.1f}x)" if r["noisy"] else ""))


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
        if value is not None and (value < 0 or (value == 0 and key in ("rounds", "timeout"))):
            raise ConfigError(f"--{key.replace('_', '-')} {value:g}: must be {'positive' if key in ('rounds', 'timeout') else '>= 0'}")
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


def ember_version() -> Optional[str]:
    """ember's installed version (its package metadata), or None where it is not installed as a package."""
    try:
        return importlib.metadata.version("ember")
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit(repo: Path) -> Optional[str]:
    """`repo`'s HEAD commit, "-dirty" after it where `git status --porcelain` lists anything (the code that ran
    is not the commit's alone); None where git is missing or `repo` is no git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=60)
        status = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True,
                                timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0 or status.returncode != 0:
        return None
    return head.stdout.strip() + ("-dirty" if status.stdout.strip() else "")


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
    add_ember_ratios(rows)
    print_table(rows)
    summary, patches = summary_lines(rows), tagged_as(tags, "patch")
    print(f"\n{summary_heading(rows)}")
    print("\n".join(f"  {line}" for line in summary) or "  (no row where ember and a peer both ran)")
    if patches:
        print("\ntorchtitan's run-time patches:\n" + "\n".join(f"  {p}" for p in patches))
    versions = peer_versions(tags, args.frameworks, peers_python)
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
        source = {"ember": ember_version(), "ember_commit": git_commit(REPO)}
        peers = [f for f in args.frameworks if f != "ember"]
        peers_python = find_peers_python(args.peers_python, dict(os.environ)) if peers else None
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
        print(f"peers.py: {how}; {finished} in {path} (marked \"interrupted\": true)", file=sys.stderr)
        return 128 + signum
    report(rows, tags, args, peers_python, source, interrupted=False)
    failed = [r for r in rows if r["status"] == "failed" or any(x["status"] != "ok" for x in r.get("rounds", []))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
