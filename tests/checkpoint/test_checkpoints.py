"""Exact resume after a crash, atomic saves, keep-N, corrupt checkpoints, signals, resharding.

Runs go through `ember train` in subprocesses, as a user's job would; faults are injected by a
sitecustomize module on PYTHONPATH (SIGKILL at a step, or death in the middle of a save).
"""

import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch

from tests.helpers import job_env, kill_injection, losses_by_step, run_ember, tiny_model, wait_for_logged_step

# Every test here trains in a subprocess (or several, or a torchrun job).
pytestmark = pytest.mark.slow

TINY = ["debug", "data.dataset=synthetic", *tiny_model(2), "model.vocab_size=256", "seq_len=32", "global_batch_size=4",
        "micro_batch_size=2", "logging_steps=1", "max_steps=6", "checkpoint.interval=2", "eval_batches=1",
        "metrics.console=false", "optim.lr=1e-2"]


def _env(tmp_path: Path, **extra: str) -> dict:
    return job_env(PYTHONPATH=str(kill_injection(tmp_path)), **extra)


def _train(tmp_path: Path, out: Path, *overrides: str, nproc: int = 1, env: dict | None = None,
           expect: int | None = 0) -> subprocess.CompletedProcess:
    launch = [f"--nproc-per-node={nproc}"] if nproc > 1 else []
    return run_ember("train", *launch, *TINY, f"output_dir={out}", *overrides, env=env or _env(tmp_path),
                     expect=expect)


def _train_state(out: Path, step: int) -> dict:
    return torch.load(out / "checkpoints" / f"step-{step}" / "train-rank0.pt", weights_only=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("A") / "run"
    _train(out.parent, out)
    return out


def test_killed_run_resumes_bit_for_bit(uninterrupted: Path, tmp_path: Path):
    out = tmp_path / "B"
    _train(tmp_path, out, env=_env(tmp_path, EMBER_KILL_AT_STEP="3"), expect=-signal.SIGKILL)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2"]
    proc = _train(tmp_path, out)
    assert "resumed from" in proc.stdout and "step-2" in proc.stdout
    a, b = losses_by_step(uninterrupted), losses_by_step(out)
    assert b == a  # every step from 3 on equals the uninterrupted run's, bit for bit (== on floats)
    assert _train_state(out, 6)["data"] == _train_state(uninterrupted, 6)["data"]  # the same data consumed


def test_score_biases_resume_bit_for_bit(tmp_path: Path):
    """DeepSeek-V3's router score biases move after every step (aux-loss-free balancing) and are model state: a
    killed run resumes with them as they were, so every later step and the final biases equal an uninterrupted run's."""
    from ember.model_io.load import load_model

    # the debug flavor's MLA and grouped sigmoid routing, two layers (one dense, one MoE)
    args = [a for a in TINY if not a.startswith("model.")] + ["model.family=deepseek_v3", "model.n_layers=2",
                                                               "model.vocab_size=256", "model.bias_update_rate=0.01"]
    for run, env, expect in (("A", _env(tmp_path), 0), ("B", _env(tmp_path, EMBER_KILL_AT_STEP="3"), -signal.SIGKILL),
                             ("B", _env(tmp_path), 0)):
        run_ember("train", *args, f"output_dir={tmp_path / run}", env=env, expect=expect)
    assert losses_by_step(tmp_path / "B") == losses_by_step(tmp_path / "A")
    biases = [{k: v for k, v in load_model(tmp_path / run).state_dict().items() if k.endswith("score_bias")}
              for run in ("A", "B")]
    assert biases[0] and all(torch.equal(biases[0][k], biases[1][k]) for k in biases[0])
    assert any(bias.abs().sum() > 0 for bias in biases[0].values())  # six steps moved them


def test_crash_in_the_middle_of_a_save_keeps_the_previous_checkpoint(uninterrupted: Path, tmp_path: Path):
    out = tmp_path / "C"
    _train(tmp_path, out, env=_env(tmp_path, EMBER_DIE_IN_SAVE_AT="4"), expect=1)
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["step-2", "step-4.tmp"]  # the half-written one is not a checkpoint
    proc = _train(tmp_path, out)
    assert "removed the incomplete checkpoint step-4.tmp" in proc.stdout
    assert "resumed from" in proc.stdout and "step-2 (step 2)" in proc.stdout
    assert losses_by_step(out) == losses_by_step(uninterrupted)


def test_fsdp2_killed_run_resumes_bit_for_bit(tmp_path: Path):
    a, b = tmp_path / "A2", tmp_path / "B2"
    _train(tmp_path, a, nproc=2)
    _train(tmp_path, b, nproc=2, env=_env(tmp_path, EMBER_KILL_AT_STEP="3"), expect=None)
    assert (b / "checkpoints" / "step-2" / "model.json").is_file()
    assert not (b / "checkpoints" / "step-6").exists()
    _train(tmp_path, b, nproc=2)
    assert losses_by_step(b) == losses_by_step(a)


def test_a_checkpoint_reshards_to_one_process_and_to_tensor_parallel(tmp_path: Path):
    a = tmp_path / "fsdp"
    _train(tmp_path, a, nproc=2)
    reference = losses_by_step(a)
    for name, extra, nproc in (("single", [], 1), ("tp", ["ici_mesh.tensor=2", "ici_mesh.fsdp=1"], 2)):
        out = tmp_path / name
        _train(tmp_path, out, f"resume={a / 'checkpoints' / 'step-4'}", *extra, nproc=nproc)
        got = losses_by_step(out)
        assert sorted(got) == [5, 6]
        for step in (5, 6):
            assert got[step][0] == pytest.approx(reference[step][0], rel=1e-5), name
            assert got[step][1] == pytest.approx(reference[step][1], rel=1e-4), name


def test_keep_and_milestones(tmp_path: Path):
    out = tmp_path / "keep"
    _train(tmp_path, out, "checkpoint.interval=1", "checkpoint.keep=2", "checkpoint.keep_every=3")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-3", "step-5", "step-6"]


def test_corrupt_checkpoints(uninterrupted: Path, tmp_path: Path):
    out = tmp_path / "corrupt"
    _train(tmp_path, out, "max_steps=4")
    shard = next((out / "checkpoints" / "step-4").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    # resume=auto: says what is wrong and falls back to step-2
    proc = _train(tmp_path, out, "max_steps=6")
    assert f"shard file {shard.name} is truncated" in proc.stdout and "falling back to step-2" in proc.stdout
    assert losses_by_step(out) == losses_by_step(uninterrupted)
    # An explicit path to a bad checkpoint is an error naming the file, with nothing overwritten.
    bad = out / "checkpoints" / "step-2"
    (bad / next(p.name for p in bad.glob("*.distcp"))).unlink()
    proc = _train(tmp_path, tmp_path / "other", f"resume={bad}", expect=2)
    assert proc.stderr.count("\n") == 1 and "shard file" in proc.stderr and "is missing" in proc.stderr
    proc = _train(tmp_path, tmp_path / "other2", f"resume={out / 'checkpoints' / 'step-6'}", "model.dim=128", expect=2)
    assert "dim: checkpoint 64, this run 128" in proc.stderr and "resume=none" in proc.stderr
    assert proc.stderr.count("\n") == 1


@pytest.mark.parametrize("sig, exit_code, stop_env", [(signal.SIGTERM, 0, None), (signal.SIGINT, 130, None),
                                                      (signal.SIGTERM, 75, "75")])
def test_stop_signal_saves_at_the_next_step_and_exits(tmp_path: Path, sig: signal.Signals, exit_code: int,
                                                      stop_env: Optional[str]):
    # SIGTERM: preemption, the run is saved and may be resumed (exit 0; EMBER_EXIT_CODE_ON_STOP, which `ember
    # launch k8s` sets, for a scheduler that restarts failed pods). SIGINT: Ctrl-C, saved the same way, with the
    # shell's "interrupted" exit status so that `ember train && next` does not go on.
    out = tmp_path / "term"
    env = _env(tmp_path, **({"EMBER_EXIT_CODE_ON_STOP": stop_env} if stop_env else {}))
    proc = subprocess.Popen([sys.executable, "-m", "ember", "train", *TINY, f"output_dir={out}", "max_steps=100000",
                             "checkpoint.interval=0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    # The first step's record means the loop runs with its signal handlers installed (metrics.jsonl itself is
    # opened before them).
    wait_for_logged_step(proc, out / "metrics.jsonl")
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == exit_code, stderr[-2000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    (step_dir,) = (out / "checkpoints").iterdir()
    step = int(step_dir.name.split("-")[1])
    assert step == max(losses_by_step(out)) and (step_dir / "model.json").is_file()  # its last step: saved, stopped
    assert f"{sig.name}: saving a checkpoint at step {step}" in stdout
    assert _train_state(out, step)["step"] == step
    if sig == signal.SIGINT:
        assert "interrupted: saving a checkpoint after this step" in stdout


def test_async_save_commits_every_checkpoint(uninterrupted: Path, tmp_path: Path):
    out = tmp_path / "async"
    _train(tmp_path, out, "checkpoint.async=true")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4", "step-6"]
    assert losses_by_step(out) == losses_by_step(uninterrupted)  # saving in the background changes nothing
