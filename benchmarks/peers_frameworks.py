"""The frameworks benchmarks/peers.py trains, each behind one interface (Runner): the command that trains the
asked shape in a fresh process, and the reading of the metrics that run wrote to files of its own.

    ember        `ember train debug` with overrides; its metrics.jsonl (`step_time_s`) and run.json (`params`)
    litgpt       peers_runners/litgpt_run.py (litgpt's pretraining); the metrics.csv of litgpt's own CSV logger
                 (`iter_time`), the runner's peers.jsonl (parameter count, version)
    torchtitan   peers_runners/torchtitan_run.py (torchtitan's trainer); the metrics.jsonl the runner's
                 MetricsProcessor writes (`time_metrics/end_to_end(s)`, torchtitan's own per-step record), the
                 runner's peers.jsonl (parameter count, version, run-time patches)

The peers' runners run in the peers' environment, which has no ember: what they write is plain JSON and CSV.
A file is read up to its last complete line, so that it can be read while its framework is still writing it.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

from ember.config import OptimConfig, load as load_config
from ember.models.llama.args import FLAVORS, LlamaArgs

RUNNER_SCRIPTS = Path(__file__).resolve().parent / "peers_runners"
FACTS_FILE = "peers.jsonl"  # peers_runners/common.py's FACTS_FILE: what a runner says about its run
TITAN_METRICS_FILE = "metrics.jsonl"  # peers_runners/torchtitan_run.py's METRICS_FILE
TITAN_STEP_TIME = "time_metrics/end_to_end(s)"  # torchtitan's key: the time between two logged steps (log_freq=1)


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


@dataclass(frozen=True)
class Job:
    """One training run asked of a framework: the same for every framework but for `out`, its own folder."""

    shape: Shape
    precision: str  # fp32 or bf16
    mode: str  # eager or compiled
    steps: int
    device: str  # cpu or cuda
    out: Path
    peers_python: Optional[Path] = None  # the peers' environment's python (not needed for ember)


@dataclass(frozen=True)
class Measured:
    """What a run's files say: its per-step seconds in step order, the parameter count of the model it built,
    and (peers only) the changes its runner made to get it running and the framework's version."""

    step_times_s: list[float]
    params: Optional[int]
    patches: list[str] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Runner:
    """One framework: how a Job is run and read. peers.py knows nothing else of a framework."""

    name: str
    command: Callable[[Job], list[str]]
    read: Callable[[Path], Measured]  # the run's output folder (Job.out) -> what its files say so far
    timing: str  # what its step time covers, for the results' notes
    default_mode: Optional[str] = None  # the mode its users get: what eager ember is held against (None: ember)
    no_run: dict[str, str] = field(default_factory=dict)  # mode -> why the framework has no run in that mode


def model_args(shape: Shape) -> LlamaArgs:
    """ember's llama3 debug flavor at `shape`: its FFN rule (multiple_of 64), RoPE theta and norm eps."""
    return dataclasses.replace(FLAVORS["llama3"]["debug"], dim=shape.dim, n_layers=shape.n_layers,
                               n_heads=shape.n_heads, n_kv_heads=shape.n_kv_heads, vocab_size=shape.vocab)


def recipe_optim() -> OptimConfig:
    """The debug recipe's optimizer settings (AdamW, clipping): ember trains with them, the peers are given them."""
    return load_config("debug", []).optim


def complete_lines(path: Path) -> str:
    """`path`'s text up to its last newline ("" when missing): a line still being written is not read yet, and
    a run killed in the middle of one leaves it unread."""
    if not path.is_file():
        return ""
    text = path.read_text(errors="replace")
    return text[:text.rfind("\n") + 1]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in complete_lines(path).splitlines() if line.strip()]


def read_facts(out: Path) -> tuple[Optional[int], list[str], list[str]]:
    """(parameter count, patches, versions) from a peer runner's FACTS_FILE: one {"kind", "value"} per line;
    a patch or version said twice (torchtitan's attention patch, once per layer count) is kept once."""
    records = read_jsonl(out / FACTS_FILE)
    said = {kind: list(dict.fromkeys(r["value"] for r in records if r["kind"] == kind))
            for kind in ("params", "patch", "version")}
    return (said["params"][0] if said["params"] else None), said["patch"], said["version"]


def steps_in_order(records: list[dict[str, Any]], step_key: str, time_key: str) -> list[float]:
    """The `time_key` of every record that has one, ordered by `step_key` (a step logged twice counts once)."""
    by_step = {int(r[step_key]): float(r[time_key]) for r in records if r.get(time_key) not in (None, "")}
    return [by_step[step] for step in sorted(by_step)]


def ember_command(job: Job) -> list[str]:
    shape = job.shape
    return [sys.executable, "-m", "ember", "train", "debug", f"model.dim={shape.dim}",
            f"model.n_layers={shape.n_layers}", f"model.n_heads={shape.n_heads}",
            f"model.n_kv_heads={shape.n_kv_heads}", f"model.vocab_size={shape.vocab}",
            f"global_batch_size={shape.batch}", f"micro_batch_size={shape.batch}", f"seq_len={shape.seq}",
            "data.dataset=synthetic", f"max_steps={job.steps}", "logging_steps=1", "schedule.name=constant",
            "schedule.warmup_steps=0", "checkpoint.interval=0", "eval_interval=0", "metrics.console=false",
            "metrics.tensorboard=false", f"compile={job.mode == 'compiled'}", f"precision={job.precision}",
            f"device={job.device}", "resume=none", f"output_dir={job.out}"]


def read_ember(out: Path) -> Measured:
    """ember's metrics.jsonl (logging_steps=1: one training record per step; the final validation's record has
    no step time) and the parameter count its run.json records."""
    times = steps_in_order(read_jsonl(out / "metrics.jsonl"), "step", "step_time_s")
    run_json = out / "run.json"
    params = json.loads(run_json.read_text())["params"] if run_json.is_file() else None
    return Measured(times, params)


def peer_command(script: str) -> Callable[[Job], list[str]]:
    """The command of a runner in peers_runners/ (their shared flags: peers_runners/common.py): ember's model at
    the job's shape, with its FFN width, RoPE theta and norm eps, and the debug recipe's optimizer."""

    def command(job: Job) -> list[str]:
        shape, llama, optim = job.shape, model_args(job.shape), recipe_optim()
        return [str(job.peers_python), str(RUNNER_SCRIPTS / script), "--dim", str(shape.dim),
                "--n-layers", str(shape.n_layers), "--n-heads", str(shape.n_heads),
                "--n-kv-heads", str(shape.n_kv_heads), "--vocab", str(shape.vocab),
                "--ffn-hidden", str(llama.ffn_hidden_dim), "--batch", str(shape.batch), "--seq", str(shape.seq),
                "--steps", str(job.steps), "--rope-theta", str(llama.rope_theta), "--norm-eps", str(llama.norm_eps),
                "--lr", str(optim.lr), "--weight-decay", str(optim.weight_decay),
                "--betas", *(str(b) for b in optim.betas), "--eps", str(optim.eps),
                "--max-norm", str(optim.max_grad_norm), "--precision", job.precision, "--mode", job.mode,
                "--device", job.device, "--out", str(job.out)]

    return command


def read_litgpt(out: Path) -> Measured:
    """litgpt's pretraining logs each iteration to its CSV logger (`logger_name="csv"`):
    OUT/logs/csv/version_0/metrics.csv, a row per iteration with `iter` and `iter_time` (seconds)."""
    files = sorted(out.glob("logs/csv/version_*/metrics.csv"))
    rows = list(csv.DictReader(complete_lines(files[-1]).splitlines())) if files else []
    params, patches, versions = read_facts(out)
    return Measured(steps_in_order(rows, "iter", "iter_time"), params, patches, versions)


def read_torchtitan(out: Path) -> Measured:
    """The record torchtitan's MetricsProcessor logs at each step (log_freq=1), as the runner writes it."""
    params, patches, versions = read_facts(out)
    times = steps_in_order(read_jsonl(out / TITAN_METRICS_FILE), "step", TITAN_STEP_TIME)
    return Measured(times, params, patches, versions)


LITGPT_EAGER = "n/a (litgpt pretrain always compiles)"
RUNNERS = {runner.name: runner for runner in (
    Runner("ember", ember_command, read_ember, timing="ember's step_time_s (data wait included)"),
    Runner("litgpt", peer_command("litgpt_run.py"), read_litgpt, default_mode="compiled",
           timing="litgpt's iter_time (no data fetch)", no_run={"eager": LITGPT_EAGER}),
    Runner("torchtitan", peer_command("torchtitan_run.py"), read_torchtitan, default_mode="eager",
           timing="torchtitan's end_to_end(s) (all of a step)"),
)}
