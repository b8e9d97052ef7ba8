"""`ember launch slurm --replica-groups R` against a real SLURM (slurm_cluster.py, three nodes: one for the
lighthouse, one per group): the lighthouse job and a job array of groups; one group's job cancelled and requeued
while the other trains on without a restart, then healed to its peer's weights bit for bit. And the scripts and
flags, checked without a cluster."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from slurm_cluster import SlurmCluster

from tests.helpers import run_ember, tiny_model
from tests.object_store import BUCKET

DOC = Path(__file__).resolve().parents[2] / "docs" / "clusters.md"

TINY = ["data.dataset=synthetic", *tiny_model(), "model.vocab_size=256", "seq_len=32", "global_batch_size=4",
        "micro_batch_size=2", "logging_steps=1", "eval_batches=1", "metrics.console=false", "device=cpu",
        "schedule.warmup_steps=0", "fault_tolerance.timeout_s=20"]
HOLD, PAUSE, STEPS = 4, 12, 20

# Loaded by every Python process of the jobs (PYTHONPATH reaches them: sbatch exports the submitting environment).
# Group 1's first run stops at its quorum for step HOLD + 1 and dies at once when SLURM ends it (as a crashed
# node's would); group 0 trains on alone, and waits at step PAUSE + 1 until the requeued group 1 asks for its
# first quorum: the survivor cannot finish before its peer is back, however fast or slow this machine is.
INJECTION = f"""
import os
if os.environ.get("EMBER_TEST_DIR") and os.environ.get("EMBER_REPLICA_GROUP") and os.environ.get("RANK"):
    import pathlib, signal, time
    import ember.train.fault_tolerance as ft
    marks = pathlib.Path(os.environ["EMBER_TEST_DIR"])
    group = int(os.environ["EMBER_REPLICA_GROUP"])
    restarted = int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0
    original_quorum = ft.ReplicaGroups._quorum
    def quorum(self):
        step = self.manager.current_step()
        if group == 1 and not restarted and step == {HOLD}:
            signal.signal(signal.SIGTERM, lambda *_: os._exit(1))
            (marks / "held").touch()
            while True:
                time.sleep(0.05)
        if group == 1 and restarted:
            (marks / "rejoined").touch()
        if group == 0 and step == {PAUSE}:
            while not (marks / "rejoined").exists():
                time.sleep(0.05)
        return original_quorum(self)
    ft.ReplicaGroups._quorum = quorum
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    slurm = SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=3)
    try:
        slurm.start()  # SlurmUnavailable fails the test, with the daemons' logs
        yield slurm
    finally:
        slurm.stop()


def _wait_for(path: Path, what: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout  # bounds a hang only
    while not path.exists():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _job(cluster: SlurmCluster, job_id: str) -> dict[str, str]:
    out = cluster.run("scontrol", "show", "job", "-o", job_id).stdout
    return dict(part.split("=", 1) for part in out.split() if "=" in part)


def _doc_command() -> list[str]:
    """docs/clusters.md's GPU cluster run with replica groups, as argv."""
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()
             if line.startswith("ember launch slurm") and "--replica-groups" in line]
    assert len(lines) == 1, lines
    return shlex.split(lines[0], comments=True)[1:]


def _on_this_cluster(argv: list[str], url: str) -> list[str]:
    """The doc's command on three CPU nodes: 2 groups of 1 process, a tiny model, the local S3 server's bucket."""
    values = {"--replica-groups": "2", "--nodes": "1", "--partition": "debug", "--lighthouse-partition": "debug"}
    out, args = [], iter(argv)
    for arg in args:
        if arg == "--gpus-per-node":  # (the doc's value is skipped)
            out += ["--nproc-per-node", "1"]
            next(args)
        elif arg in values:
            out += [arg, values[arg]]
            next(args)
        elif arg.startswith("--"):
            out += [arg, next(args)]
        elif arg.startswith("output_dir="):
            out.append(f"output_dir={url}")
        elif arg == "llama3.1-8b":
            out += ["debug", *TINY, f"max_steps={STEPS}", "checkpoint.interval=3"]
        else:
            out.append(arg)
    return out


@pytest.mark.slow
def test_a_requeued_group_heals_while_the_other_trains_on(cluster: SlurmCluster, s3_server, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch):
    """docs/clusters.md's command, run on this cluster and the local S3 server: group 1's job is cancelled and
    requeued at step 4; group 0's job trains on without a restart, the requeued group heals from it, both end with
    the same weights, bit for bit."""
    url = f"s3://{BUCKET}/slurm-groups"
    marks, inject = tmp_path / "marks", tmp_path / "inject"
    marks.mkdir()
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(INJECTION)
    env = s3_server.env(**{"SLURM_CONF": cluster.env["SLURM_CONF"], "OMP_NUM_THREADS": "1",
                           "EMBER_TEST_DIR": str(marks), "EMBER_CACHE": str(tmp_path / "cache"),
                           "PYTHONPATH": f"{inject}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    argv = _on_this_cluster(_doc_command(), url)
    launch = subprocess.Popen([sys.executable, "-m", "ember", *argv, "--wait"], env=env, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = tmp_path / "ember-launch" / f"s3-{BUCKET}-slurm-groups"  # the scripts and logs of a run on a store
    try:
        _wait_for(marks / "held", "group 1 to reach its hold")
        groups_id = (out / "launch" / "ember-debug.groups-job").read_text().strip()
        # while it runs: the same submission again is refused (two jobs would write one run), and the array's
        # status is one line per group
        again = run_ember(*argv, env=env, cwd=tmp_path)
        assert again.returncode == 2 and f"still in the queue (job {groups_id}" in again.stderr, again.stderr
        status = run_ember("launch", "status", groups_id, env=env).stdout.splitlines()
        assert [line.split(":")[0] for line in status] == [f"job {groups_id}_{g} ember-debug" for g in (0, 1)]
        cluster.run("scontrol", "requeue", f"{groups_id}_1")  # cancel the running job and put it back in the queue
        stdout, stderr = launch.communicate(timeout=900)
    finally:
        if launch.poll() is None:
            launch.kill()
    assert launch.returncode == 0, stdout[-3000:] + stderr[-3000:] + cluster.logs()
    assert f"replica group 1: job {groups_id}_1 RUNNING" in stdout and "restarts 1" in stdout
    assert "done: 2 replica groups completed" in stdout
    # the survivor ran once, start to end; the requeued group started twice and healed from it
    log0 = (out / "logs" / f"ember-debug-{groups_id}_0.out").read_text()
    log1 = (out / "logs" / f"ember-debug-{groups_id}_1.out").read_text()
    assert log0.count("started (restart") == 1 and "resumed from" not in log0, log0[-3000:]
    assert _job(cluster, f"{groups_id}_0").get("Restarts") == "0"
    assert "started (restart 1)" in log1 and "replica group 1: healed from a live peer at step" in log1, log1[-3000:]
    # group 0's record names the steps it ran alone, with half the tokens
    store = s3_server.filesystem()
    records = [json.loads(line) for line in store.cat(f"{url}/metrics.jsonl").decode().splitlines()]
    degraded = {r["step"]: r for r in records if "replica_groups" in r}
    assert set(range(HOLD + 1, PAUSE + 1)) <= set(degraded) <= set(range(HOLD + 1, PAUSE + 2)), sorted(degraded)
    assert all(r["replica_groups"] == [0] and r["tokens"] == 2 * 32 for r in degraded.values())
    assert max(r["step"] for r in records if "loss" in r) == STEPS
    # the lighthouse's job ended by itself once both groups had
    deadline = time.monotonic() + 120
    while "the replica groups have ended" not in (text := _lighthouse_log(out)) and time.monotonic() < deadline:
        time.sleep(1)
    assert "the replica groups have ended" in text, text
    from ember.model_io.load import load_model

    for name, value in env.items():
        if name.startswith("AWS_") or name == "EMBER_CACHE":
            monkeypatch.setenv(name, value)
    mine, peer = load_model(url).state_dict(), load_model(f"{url}/replica-group-1").state_dict()
    assert mine.keys() == peer.keys() and all(torch.equal(mine[k], peer[k]) for k in mine)


def test_groups_that_cannot_all_run_at_once_are_refused(cluster: SlurmCluster, tmp_path: Path):
    """Three nodes: three groups and the lighthouse cannot run together (a late group would train alone); a
    mistyped --lighthouse-partition is named as such. Nothing is queued."""
    env = dict(cluster.env, OMP_NUM_THREADS="1")
    base = ["launch", "slurm", "debug", *TINY, "global_batch_size=12", f"output_dir={tmp_path / 'run'}",
            "--nproc-per-node", "1"]
    proc = run_ember(*base, "--replica-groups", "3", env=env)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "3 replica groups of 1 node(s) and the lighthouse need 4 nodes at once, and the default partition has " \
           "3" in proc.stderr and "--lighthouse-partition" in proc.stderr
    proc = run_ember(*base, "--replica-groups", "2", "--lighthouse-partition", "nosuch", env=env)
    assert proc.returncode == 2 and "--lighthouse-partition names no partition" in proc.stderr, proc.stderr
    assert not cluster.run("squeue", "-h").stdout.strip()


def _lighthouse_log(out: Path) -> str:
    return next((out / "logs").glob("ember-debug-lighthouse-*.out")).read_text()


def test_the_scripts_are_valid_bash_and_the_groups_an_array_after_the_lighthouse(tmp_path: Path):
    out = tmp_path / "run"
    proc = run_ember("launch", "slurm", "debug", *TINY, f"output_dir={out}", "fault_tolerance.min_replica_groups=2",
                     "global_batch_size=12", "--replica-groups", "3", "--nodes", "2", "--max-restarts", "5",
                     "--lighthouse-partition", "cpu", "--partition", "gpu", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    groups, lighthouse = (out / "launch" / "ember-debug.sbatch"), (out / "launch" / "ember-debug-lighthouse.sbatch")
    for script in (groups, lighthouse):
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = groups.read_text()
    assert "#SBATCH --array=0-2" in text and "%x-%A_%a.out" in text and "--max-restarts 5" in text
    assert 'export EMBER_REPLICA_GROUP="$SLURM_ARRAY_TASK_ID"' in text and "ember-debug.lighthouse" in text
    assert "fault_tolerance.enable=true fault_tolerance.replica_groups=3" in text and "dcn_mesh.fsdp=2" in text
    assert "#SBATCH --partition=gpu" in text
    light = lighthouse.read_text()
    assert "--min_replicas 2" in light and "#SBATCH --partition=cpu" in light and "--exclusive" not in light
    assert proc.stdout == text  # --dry-run prints the groups' script
    assert "for each of 3 replica groups" in proc.stderr


@pytest.mark.parametrize("flags, message", [
    (["--max-restarts", "2"], "--max-restarts and --lighthouse-partition go with --replica-groups R"),
    (["--lighthouse-partition", "cpu"], "--max-restarts and --lighthouse-partition go with --replica-groups R"),
    (["--replica-groups", "-1"], "--replica-groups must be >= 1, got -1"),
    (["--replica-groups", "0"], "--replica-groups must be >= 1, got 0"),
    (["--replica-groups", "2", "fault_tolerance.replica_groups=3"],
     "--replica-groups 2 contradicts fault_tolerance.replica_groups=3"),
    (["--replica-groups", "3"], "not divisible by micro_batch_size x data-parallel size (over "
     "fault_tolerance.replica_groups) = 2 x 3 = 6"),
])
def test_bad_replica_group_flags_are_one_line_and_write_nothing(tmp_path: Path, flags, message):
    out = tmp_path / "run"
    proc = run_ember("launch", "slurm", "debug", *TINY, f"output_dir={out}", *flags, "--dry-run")
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not out.exists()


def test_a_run_that_already_holds_its_last_step_is_not_submitted(tmp_path: Path):
    """Resubmitting a finished run (resume=auto) would book nodes only to say "nothing to train": refused first."""
    from ember.checkpoint.run_dir import MODEL_JSON

    out = tmp_path / "run"
    (out / "checkpoints" / "step-8").mkdir(parents=True)
    (out / "checkpoints" / "step-8" / MODEL_JSON).write_text("{}")
    proc = run_ember("launch", "slurm", "debug", *TINY, "max_steps=8", f"output_dir={out}")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"{out} already holds step 8 of max_steps=8: nothing to train; raise max_steps" in proc.stderr
    assert not (out / "launch").exists()
