"""`ember launch`'s command line: help, and one-line errors before anything is started or submitted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from tests.helpers import run_ember, tiny_model, wait_for_logged_step


@pytest.mark.slow
def test_help_and_one_line_errors(tmp_path):
    for argv in (["launch", "--help"], ["launch", "slurm", "--help"], ["launch", "k8s", "--help"],
                 ["launch", "local", "--help"]):
        proc = run_ember(*argv)
        assert proc.returncode == 0 and "usage: ember launch" in proc.stdout, argv
    # The config is checked for nodes x processes: 3 processes cannot hold tensor=2.
    proc = run_ember("launch", "local", "--nproc-per-node", "3", "debug", "ici_mesh.tensor=2")
    assert proc.returncode == 2 and proc.stderr.startswith("error: the world size 3") and proc.stderr.count("\n") == 1
    proc = run_ember("launch", "slurm", "debug", "--nodes", "3", "--nproc-per-node", "1", f"output_dir={tmp_path}",
                     "--dry-run")
    assert proc.returncode == 2 and "global_batch_size" in proc.stderr and proc.stderr.count("\n") == 1
    assert not (tmp_path / "launch").exists()  # nothing written
    proc = run_ember("launch", "slurm", "debug", "--nodes", "0")
    assert proc.returncode == 2 and "--nodes must be >= 1" in proc.stderr
    proc = run_ember("launch", "local", "--bogus", "1")
    assert (proc.returncode, proc.stderr) == (2, "error: unknown option '--bogus' for ember launch local (options: "
                                              "--nproc-per-node, --nnodes, --node-rank, --rdzv-endpoint, "
                                              "--replica-groups, --max-restarts)\n")


def test_a_job_id_is_checked_and_overrides_are_optional(capsys):
    from ember import cli

    for command in ("status", "cancel", "logs"):
        assert cli.main(["launch", command, "abc"]) == 2
        assert capsys.readouterr() == ("", "error: argument JOB: 'abc' is not a SLURM job id (a number such as 1234; "
                                       f"1234_5 for an array task) (see ember launch {command} --help)\n")
    # Without arguments: the usage, and only the recipe named as required (key=value overrides are optional).
    assert cli.main(["launch", "slurm"]) == 2
    assert capsys.readouterr().err.endswith("ember launch slurm: error: the following arguments are required: recipe\n")


@pytest.mark.slow
def test_what_is_requested_is_what_the_flags_say_and_is_printed(tmp_path):
    # --nproc-per-node: processes only (device=auto asks a CPU cluster for no GPU); --gpus-per-node: one GPU each.
    script = tmp_path / "launch" / "ember-debug.sbatch"
    cases = [(["--nodes", "2", "--nproc-per-node", "1"], None,
              "requesting 2 nodes x 1 process each, no GPU (device=auto; --gpus-per-node G requests G GPUs per node)"),
             (["--gpus-per-node", "2"], "#SBATCH --gpus-per-node=2",
              "requesting 1 node x 2 processes each, 2 GPUs per node"),
             (["--nproc-per-node", "2", "device=cuda"], "#SBATCH --gpus-per-node=2",
              "requesting 1 node x 2 processes each, 2 GPUs per node")]
    for flags, gpu_line, request in cases:
        proc = run_ember("launch", "slurm", "debug", "micro_batch_size=4", f"output_dir={tmp_path}", *flags,
                         "--dry-run")
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr.splitlines()[0] == request, (flags, proc.stderr)
        lines = script.read_text().splitlines()
        assert [line for line in lines if line.startswith("#SBATCH --gpus")] == ([gpu_line] if gpu_line else []), flags
    for flags, message in ((["--gpus-per-node", "1", "device=cpu"], "error: --gpus-per-node 1 requests GPUs for a "
                            "device=cpu job; give --nproc-per-node 1 for CPU processes, or drop device=cpu"),
                           (["--gpus-per-node", "2", "--nproc-per-node", "2"], "error: give --gpus-per-node G (G "
                            "processes and G GPUs per node) or --nproc-per-node G (G processes), not both")):
        proc = run_ember("launch", "slurm", "debug", "micro_batch_size=4", f"output_dir={tmp_path / 'no'}", *flags)
        assert proc.returncode == 2 and proc.stderr == message + "\n", proc.stderr
        assert not (tmp_path / "no").exists()


@pytest.mark.slow
def test_print_and_dry_run_mean_the_same_for_slurm_and_k8s(tmp_path):
    for where, extra, written in (("slurm", [], "ember-debug.sbatch"),
                                  ("k8s", ["--image", "img:1"], "ember-debug.yaml")):
        outputs = {}
        for flag in ("--print", "--dry-run"):
            out = tmp_path / where / flag.strip("-")
            proc = run_ember("launch", where, "debug", "device=cpu", f"output_dir={out}", *extra, flag)
            assert proc.returncode == 0, (where, flag, proc.stderr)
            path = out / "launch" / written
            text = path.read_text()
            assert proc.stdout == text  # printed alone; a slurm --print submits nothing (no sbatch here either)
            note = ("not submitted: --dry-run" if where == "slurm"
                    else f"not applied: `kubectl apply -f {path}` starts it")
            assert proc.stderr.splitlines()[-1] == f"wrote {path} ({note})", proc.stderr
            header = ("# Written", "#   ember launch")  # the date and the command line differ
            outputs[flag] = [line for line in text.replace(str(out), "OUT").splitlines() if not line.startswith(header)]
        assert outputs["--print"] == outputs["--dry-run"], where


TINY = ["debug", "data.dataset=synthetic", *tiny_model(2), "model.vocab_size=256", "seq_len=32", "global_batch_size=4",
        "micro_batch_size=2", "logging_steps=1", "max_steps=100000", "checkpoint.interval=0", "metrics.console=false"]


@pytest.mark.slow
@pytest.mark.parametrize("sig, exit_code, stop_env", [(signal.SIGINT, 130, None), (signal.SIGTERM, 0, None),
                                                      (signal.SIGTERM, 75, "75")])
def test_a_signal_to_the_launcher_is_one_line_and_the_single_process_exit_code(
        tmp_path: Path, sig: signal.Signals, exit_code: int, stop_env: Optional[str]):
    # torchrun's agent passes the signal on to the ranks, which save and stop; its own SignalException is not a
    # traceback, and the exit code is a single process's: 130 for Ctrl-C, 0 or EMBER_EXIT_CODE_ON_STOP for SIGTERM.
    out = tmp_path / "run"
    env = {name: value for name, value in os.environ.items() if name != "EMBER_EXIT_CODE_ON_STOP"}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               **({"EMBER_EXIT_CODE_ON_STOP": stop_env} if stop_env else {}))
    proc = subprocess.Popen([sys.executable, "-m", "ember", "launch", "local", "--nproc-per-node", "1", *TINY,
                             f"output_dir={out}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    # A logged step: the rank's loop runs with its handlers (and the launcher's were installed before it started
    # the rank).
    wait_for_logged_step(proc, out / "metrics.jsonl")
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == exit_code, stderr[-3000:]
    assert stderr == (f"stopped by {sig.name}: passed on to every rank (a training run saves a checkpoint at its next "
                      "step and exits; the ranks' lines above say what each did)\n")
    (step_dir,) = (out / "checkpoints").iterdir()
    assert f"{sig.name}: saving a checkpoint at step {step_dir.name.split('-')[1]} and exiting" in stdout


def test_launch_local_help_says_what_it_equals(capsys):
    from ember import cli

    assert cli.main(["launch", "local", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ember launch local [--nproc-per-node N")
    assert "the same as `torchrun --nproc-per-node N -m ember train ...`" in out and "-m ember launch" not in out


def test_a_slurm_time_limit_is_checked_before_anything_is_written(tmp_path, capsys):
    from ember import cli
    from ember.launch.slurm import check_time

    for value in ("90", "30:00", "24:00:00", "2-12", "2-12:30", "2-12:30:15", "UNLIMITED"):
        check_time(value)
    for value in ("abc", "1.5", "1:2:3:4", "2-", "-5", "24h"):
        # --nproc-per-node 2 with the recipe's batch fails the config's batch check: the flag is said first
        assert cli.main(["launch", "slurm", "debug", "--nodes", "1", "--nproc-per-node", "2", "--time", value,
                         "--dry-run", f"output_dir={tmp_path}"]) == 2
        assert capsys.readouterr() == ("", f"error: --time '{value}' is not a SLURM time limit; give minutes (90), "
                                           "MM:SS, HH:MM:SS (24:00:00), D-HH, D-HH:MM or D-HH:MM:SS (2-00:00:00)\n")
    assert not (tmp_path / "launch").exists()
