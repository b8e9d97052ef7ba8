"""`ember launch slurm` against a real SLURM: slurmctld and two slurmds on this machine (slurm_cluster.py).
Two nodes train like one process, a preempted job saves, requeues and resumes bit for bit, a failing rank ends
the job with its rank named, and the script is valid bash that names no secret. If slurm or munge cannot be
started these tests fail (apt-get install -y slurm-wlm munge); they never skip."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster

from ember.launch.failures import first_failure
from tests.helpers import read_records, run_ember, tiny_model

# Every test here starts a SLURM cluster; most submit training jobs to it.
pytestmark = pytest.mark.slow

# A tiny Llama on synthetic tokens, on CPU with gloo: a step takes ~10 ms, so a run is mostly process start.
TINY = ["data.dataset=synthetic", *tiny_model(), "model.vocab_size=256", "seq_len=32", "global_batch_size=4",
        "logging_steps=1", "eval_batches=1", "metrics.console=false", "device=cpu", "checkpoint.interval=0",
        "schedule.warmup_steps=0"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    slurm = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        slurm.start()  # SlurmUnavailable fails the tests that use it, with the daemons' logs
        yield slurm
    finally:
        slurm.stop()


def _env(cluster: SlurmCluster) -> dict[str, str]:
    # One thread per process in the job and in the reference runs: the same float sums on both sides.
    return dict(cluster.env, OMP_NUM_THREADS="1")


def _ember(cluster: SlurmCluster, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    # The timeout only bounds a hang: two slurmds and their jobs share this machine's cores with everything else.
    return run_ember(*args, timeout=timeout, env=_env(cluster))


def _records(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_records(out) if "loss" in r}


def _job_id(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout.split("submitted job ")[1].split(":")[0]


def _wait_for_step(out: Path, step: int, timeout: float = 600) -> None:
    """Poll the job's metrics until `step`; the ceiling only bounds a hang (a loaded machine is slow, not wrong)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (out / "metrics.jsonl").is_file() and max(_records(out), default=0) >= step:
            return
        time.sleep(0.1)
    raise AssertionError(f"the job did not reach step {step}")


def test_two_nodes_train_like_one_process(cluster: SlurmCluster, tmp_path: Path):
    out = tmp_path / "two-nodes"
    proc = _ember(cluster, "launch", "slurm", "debug", *TINY, "max_steps=4", "micro_batch_size=2",
                  f"output_dir={out}", "--nodes", "2", "--nproc-per-node", "1", "--wait")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + cluster.logs()
    assert "job" in proc.stdout and "COMPLETED" in proc.stdout
    assert "dcn_mesh.fsdp=2" in (out / "launch" / "ember-debug.sbatch").read_text()  # inferred from --nodes
    assert "fsdp: 2" in (out / "config.yaml").read_text().split("dcn_mesh:")[1].split("parallel:")[0]
    ref = tmp_path / "one-process"
    single = _ember(cluster, "train", "debug", *TINY, "max_steps=4", "micro_batch_size=4", f"output_dir={ref}")
    assert single.returncode == 0, single.stderr[-2000:]
    two, one = _records(out), _records(ref)
    assert sorted(two) == sorted(one) == [1, 2, 3, 4]
    for step in one:
        assert two[step]["loss"] == pytest.approx(one[step]["loss"], rel=1e-5)
        assert two[step]["grad_norm"] == pytest.approx(one[step]["grad_norm"], rel=1e-5)


def test_preempted_job_saves_requeues_and_resumes_bit_for_bit(cluster: SlurmCluster, tmp_path: Path):
    out, steps = tmp_path / "preempted", 400
    run = [*TINY, f"max_steps={steps}", "micro_batch_size=4"]
    proc = _ember(cluster, "launch", "slurm", "debug", *run, f"output_dir={out}", "--nodes", "1")
    assert proc.returncode == 0, proc.stderr
    job = _job_id(proc)
    _wait_for_step(out, 20)
    # What SLURM does --signal-seconds before the time limit (--signal=B:USR1@120), sent now.
    cluster.run("scancel", "--batch", "--signal=USR1", job)
    # SLURM holds a requeued job back for AuthInfo's cred_expire (120 s by default, 10 s in this cluster's
    # slurm.conf: releasing it earlier by hand races the node's cleanup, "Job credential revoked"); the
    # requeued job then starts by itself, as on a real cluster.
    deadline = time.monotonic() + 600  # bounds a hang only: the requeue normally takes cred_expire, ~10 s
    while "Restarts=1" not in (info := cluster.run("scontrol", "show", "job", "-o", job).stdout):
        assert time.monotonic() < deadline and "JobState=COMPLETED" not in info, info
        time.sleep(0.2)
    follow = _ember(cluster, "launch", "logs", job, "--follow")
    assert follow.returncode == 0, follow.stdout[-3000:] + follow.stderr[-2000:]
    log = follow.stdout
    assert "SIGUSR1: saving a checkpoint at step" in log and "requeueing job" in log
    saved = int(log.split("SIGUSR1: saving a checkpoint at step ")[1].split()[0])
    assert 20 <= saved < steps and f"resumed from {out / 'checkpoints' / f'step-{saved}'}" in log
    assert {p.name for p in (out / "checkpoints").iterdir()} == {f"step-{saved}", f"step-{steps}"}
    ref = tmp_path / "uninterrupted"
    single = _ember(cluster, "train", "debug", *run, f"output_dir={ref}")
    assert single.returncode == 0, single.stderr[-2000:]
    resumed, uninterrupted = _records(out), _records(ref)
    assert sorted(resumed) == list(range(1, steps + 1))
    for step in uninterrupted:  # bit for bit: equal floats, not close ones
        assert (resumed[step]["loss"], resumed[step]["grad_norm"]) == (
            uninterrupted[step]["loss"], uninterrupted[step]["grad_norm"]), step


def _rank_pid(job: str, rank: int) -> int:
    """The training process of `rank` in `job`: found by its environment (torchrun sets RANK; the script,
    EMBER_RUN_ID)."""
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            env = dict(item.split("=", 1) for item in environ.read_text().split("\0") if "=" in item)
        except OSError:
            continue
        if env.get("EMBER_RUN_ID") == job and env.get("RANK") == str(rank) and "TORCHELASTIC_RUN_ID" in env:
            return int(environ.parent.name)
    raise AssertionError(f"no process of rank {rank} in job {job}")


def test_a_failing_rank_ends_the_job_and_is_named(cluster: SlurmCluster, tmp_path: Path):
    out = tmp_path / "crash"
    proc = _ember(cluster, "launch", "slurm", "debug", *TINY, "max_steps=100000", "micro_batch_size=2",
                  "parallel.timeout_s=3600", f"output_dir={out}", "--nodes", "2", "--nproc-per-node", "1")
    assert proc.returncode == 0, proc.stderr
    job = _job_id(proc)
    _wait_for_step(out, 3)
    os.kill(_rank_pid(job, 1), signal.SIGKILL)  # rank 1 dies as the OOM killer would end it
    # The job ends because a rank died, not at the collectives' timeout (an hour here): following it returns
    # well inside the ceiling, which only bounds a hang.
    follow = _ember(cluster, "launch", "logs", job, "--follow", timeout=600)
    assert follow.returncode != 0, follow.stderr[-2000:]
    assert "first failing rank: 1 (killed by signal 9, SIGKILL)" in follow.stderr, follow.stderr[-3000:]
    assert "first failing rank: 1" in follow.stdout  # the script printed it into the job's log too


def test_the_script_is_valid_bash_and_names_no_secret(cluster: SlurmCluster, tmp_path: Path):
    secret = "hf_s3cretValue0123456789"
    env = dict(_env(cluster), HF_TOKEN=secret)
    out = tmp_path / "dry"
    args = ["launch", "slurm", "debug", *TINY, "micro_batch_size=2", f"output_dir={out}", "--nodes", "2",
            "--nproc-per-node", "1", "--env", "HF_TOKEN", "--env", "NCCL_DEBUG=INFO", "--partition", "debug", "--time",
            "01:00:00", "--container", "nvcr.io/example/ember:1", "--mounts", "/data:/data", "--dry-run"]
    proc = run_ember(*args, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    script = out / "launch" / "ember-debug.sbatch"
    text = script.read_text()
    assert proc.stdout.strip() == text.strip() and not list((out / "logs").iterdir())  # printed, not submitted
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    assert secret not in text and "HF_TOKEN" in text  # forwarded by name only
    assert "--container-image=nvcr.io/example/ember:1" in text and "HF_TOKEN" in text.split("--container-env=")[1]
    assert "#SBATCH --requeue" in text and "#SBATCH --signal=B:USR1@120" in text and "%x-%j.out" in text
    # A secret given by value is refused, in one line that does not repeat it; so is a name that is not set.
    for bad, words in ((["--env", f"HF_TOKEN={secret}"], "by name"), (["--env", "EMBER_NOT_SET_ANYWHERE"], "not set")):
        proc = run_ember(*args, *bad, env=env, timeout=120)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and words in proc.stderr, proc.stderr
        assert secret not in proc.stderr


def test_sbatch_refusals_are_one_line_with_the_likely_fix(cluster: SlurmCluster, tmp_path: Path):
    # This cluster has CPUs only: a GPU request, or a partition it does not have, is refused by sbatch itself.
    script = tmp_path / "run" / "launch" / "ember-debug.sbatch"
    for flags, expected in (
            (["--gpus-per-node", "1"], f"error: sbatch refused {script}: Invalid generic resource (gres) "
             "specification; this partition has no GPUs to give (gres): start processes without a GPU request "
             "(--nproc-per-node instead of --gpus-per-node, or device=cpu) or choose a GPU --partition"),
            (["--nproc-per-node", "1", "--partition", "gpu"], f"error: sbatch refused {script}: Invalid partition "
             "name specified; --partition names no partition of this cluster (`sinfo -s` lists them)")):
        proc = _ember(cluster, "launch", "slurm", "debug", *[o for o in TINY if o != "device=cpu"],
                      "micro_batch_size=4", f"output_dir={tmp_path / 'run'}", *flags)
        assert proc.returncode == 2 and proc.stderr.splitlines()[-1] == expected, proc.stderr
        assert [line for line in proc.stderr.splitlines() if line.startswith("error:")] == [expected]


def test_an_unknown_job_is_one_line_and_exit_2_for_every_job_command(cluster: SlurmCluster):
    expected = ("error: job 999999 is not known to SLURM (finished more than MinJobAge ago, or on another cluster): "
                "`sacct -j 999999` has its record; its log is OUTPUT_DIR/logs/<job name>-999999.out\n")
    for command in (["status"], ["logs"], ["logs", "--follow"], ["cancel"]):
        proc = _ember(cluster, "launch", *command, "999999")
        assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", expected), command


def test_first_failure_prefers_the_cause_over_its_consequences():
    log = ("ember: job 7 started (restart 0)\nerror: [rank 1] RuntimeError: boom\n")  # the old start
    log += ("ember: job 7 started (restart 1)\n"
            "error: [rank 0] DistBackendError: Connection closed by peer [127.0.0.1]:1234\n"
            "error: [rank 3] ValueError: shapes do not match\n")
    assert first_failure(log) == "first failing rank: 3 (ValueError: shapes do not match)"
    killed = ("ember: job 8 started (restart 0)\nerror: [rank 0] RuntimeError: Connection reset by peer\n"
              "Root Cause (first observed failure):\n[0]:\n  time      : 2026-11-24_19:10:19\n  host      : vm\n"
              "  rank      : 2 (local_rank: 0)\n  exitcode  : -9 (pid: 4321)\n")
    assert first_failure(killed) == "first failing rank: 2 (killed by signal 9, SIGKILL)"
    assert first_failure("ember: job 9 started\nall good\n") is None
