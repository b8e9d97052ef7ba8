"""Helpers shared across the suite, imported as `from tests.helpers import ...`: the `ember` command in a
subprocess, the metrics.jsonl reader, the tiny model's overrides, the environment of a training subprocess
and the fault injection it can carry."""

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Optional

import pytest

if TYPE_CHECKING:
    import torch

LAYOUTS_WORKER = Path(__file__).parent / "parallel" / "layouts_worker.py"
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/NAME.py as a module (benchmarks/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass in it looks its module up there
    spec.loader.exec_module(module)
    return module


def run_ember(*args: str, timeout: float = 600, env: Optional[dict[str, str]] = None, cwd: Optional[Path] = None,
              expect: Optional[int] = None) -> subprocess.CompletedProcess:
    """`python -m ember ARGS` in a subprocess, its output captured as text; ENV (the whole environment) and CWD
    default to this process's. EXPECT, when given, is the exit status asserted (stderr's tail the message). The
    timeout only bounds a hang: a loaded machine is slow, never wrong."""
    proc = subprocess.run([sys.executable, "-m", "ember", *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=cwd)
    if expect is not None:
        assert proc.returncode == expect, proc.stderr[-3000:]
    return proc


def read_records(run: Path) -> list[dict]:
    """RUN/metrics.jsonl's records, in file order."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def losses_by_step(run: Path) -> dict[int, tuple[float, float]]:
    """(loss, grad_norm) per logged step; a step logged twice (before a crash, then after the resume) keeps the
    last."""
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in read_records(run) if "loss" in r}


def write_jsonl(path: Path, rows: list[dict]) -> str:
    """Writes ROWS as JSON lines to PATH; returns the path as the string a `key=value` override takes."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def tiny_model(n_layers: int = 1) -> list[str]:
    """The overrides of the suite's smallest llama: dim 64, 4 query and 2 K/V heads (tensor=2 splits both)."""
    return [f"model.n_layers={n_layers}", "model.dim=64", "model.n_heads=4", "model.n_kv_heads=2"]


def tiny_llama(vocab_size: int, family: str = "llama3.1") -> "torch.nn.Module":
    """A 2-layer Llama of dim 64 built in this process, seeded weights, in eval mode (no run, no checkpoint)."""
    import torch

    from ember.models import MODELS, build_model_args

    args = build_model_args(family, "debug", {"n_layers": 2, "dim": 64, "n_heads": 4, "n_kv_heads": 2,
                                              "vocab_size": vocab_size, "max_seq_len": 64})
    torch.manual_seed(0)
    model = MODELS[family].model_cls(args)
    model.init_weights()
    return model.eval()


# A tiny run of the debug recipe, each step a fraction of a second on a CPU: what eval and generate load.
TINY_RUN = [*tiny_model(), "seq_len=32", "global_batch_size=2", "micro_batch_size=2", "metrics.console=false",
            "eval_batches=1"]


def job_env(**extra: str) -> dict[str, str]:
    """The environment of a training subprocess: one thread per process (the ranks share two cores), no
    warnings, and no RANK / WORLD_SIZE inherited from a launcher around pytest."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **extra)
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    return env


# A sitecustomize that kills a training process: EMBER_KILL_AT_STEP=N sends SIGKILL to rank 0 at step N;
# EMBER_DIE_IN_SAVE_AT=N exits after every shard of step-N is written but before the save is committed.
KILL_INJECTION = """
import os
if os.environ.get("EMBER_KILL_AT_STEP") or os.environ.get("EMBER_DIE_IN_SAVE_AT"):
    import signal
    import ember.train.trainer as t
    import ember.checkpoint.manager as c
    kill_at = int(os.environ.get("EMBER_KILL_AT_STEP", -1))
    original_step = t.Trainer.train_step
    def train_step(self, batches):
        if self.step == kill_at and os.environ.get("RANK", "0") == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        return original_step(self, batches)
    t.Trainer.train_step = train_step
    die_at = os.environ.get("EMBER_DIE_IN_SAVE_AT")
    original_commit = c.CheckpointManager._commit
    def commit(self, tmp, final):
        if die_at and final.name == "step-" + die_at:
            os._exit(1)  # every shard written, the commit not done: a crash in the middle of the save
        return original_commit(self, tmp, final)
    c.CheckpointManager._commit = commit
"""


def kill_injection(folder: Path) -> Path:
    """Writes KILL_INJECTION as FOLDER/inject/sitecustomize.py and returns that directory, for PYTHONPATH: every
    Python process started with it runs the injection at start-up (inert without the two variables)."""
    inject = folder / "inject"
    inject.mkdir(exist_ok=True)
    (inject / "sitecustomize.py").write_text(KILL_INJECTION)
    return inject


def run_layouts(tmp_path: Path, nproc: int, cases: dict[str, list[str]], base: list[str]) -> dict:
    """Trains every case (its overrides after BASE, on the debug recipe) in one torchrun job of NPROC ranks
    (tests/parallel/layouts_worker.py); returns each case's per-step losses, grad norms, val loss and expert
    loads. The runs stay in TMP_PATH/results.json.runs/CASE."""
    out = tmp_path / "results.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(LAYOUTS_WORKER), str(out), json.dumps(cases), *base]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=job_env(), timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


# A parallel layout against one process, in fp32. Step 1 starts from the same weights on the same batch: only the
# order of fp32 sums differs (reduce-scatters, sharded matmuls, gathered attention), measured <= 3.3e-7 relative on
# every family's layouts under this CPU's kernels and under AVX2's (ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=
# AVX2 ATEN_CPU_CAPABILITY=avx2). Losses stay that close at later steps (<= 2e-6 measured) and are held to it too.
EXACT_REL = 1e-5
# A later step's gradient norm is bounded by what Adam makes of step 1's rounding: its first update moves every
# weight by about lr whatever the size of its gradient (m / sqrt(v) = g / |g|), so a gradient at the rounding noise
# level (Qwen3's q/k norm weights, Gemma's (1 + w) norms, whose gradients nearly cancel) moves its weight by +-lr
# depending on the summation order, and the next gradient moves with it. Measured up to 3.5e-5 (Qwen3 tensor=2,
# AVX2) and 1.2e-3 (Gemma 3 context=2, AVX2) at lr 1e-2; the bound is a quarter of lr.
ADAM_GNORM_REL_PER_LR = 0.25


def assert_trains_like(got: dict, expected: dict, lr: float, name: str) -> None:
    """A layout's per-step `loss` and `grad_norm` (and `val_loss` when both have one) against one process's:
    step 1 and every loss within EXACT_REL; later gradient norms within ADAM_GNORM_REL_PER_LR x lr."""
    assert len(got["loss"]) == len(expected["loss"]) >= 1, name
    assert got["loss"] == pytest.approx(expected["loss"], rel=EXACT_REL), name
    assert got["grad_norm"][0] == pytest.approx(expected["grad_norm"][0], rel=EXACT_REL), name
    assert got["grad_norm"][1:] == pytest.approx(expected["grad_norm"][1:], rel=ADAM_GNORM_REL_PER_LR * lr), name
    if got.get("val_loss") is not None and expected.get("val_loss") is not None:
        assert got["val_loss"] == pytest.approx(expected["val_loss"], rel=EXACT_REL), name


def wait_for_logged_step(proc: subprocess.Popen, metrics: Path, ceiling_s: float = 600) -> None:
    """Wait until a training subprocess has logged its first step (its loop then runs with its signal handlers
    installed). The ceiling only bounds a hang: a loaded machine is slow to get there, never wrong."""
    deadline = time.monotonic() + ceiling_s
    while '"loss"' not in (metrics.read_text() if metrics.is_file() else ""):
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, "the run logged no step"
        time.sleep(0.05)


class IdTokenizer:
    """Token ids as text, so tests need no trained tokenizer: "5 17 3" <-> [5, 17, 3]."""
    eos_id = 1

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids) -> str:
        return "".join(f" {i}" for i in ids)
