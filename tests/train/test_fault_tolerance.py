"""In-job fault tolerance over replica groups (ember/train/fault_tolerance.py, torchft): the config's errors, the
healing state's round trip, a group killed and healed among live peers, DiLoCo against a hand-computed outer step,
and `ember launch local --replica-groups`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ember.errors import ConfigError
from ember.train import fault_tolerance as ft
from ember.train.run import load_config
from tests.helpers import KILL_INJECTION, job_env, read_records, run_ember, tiny_model

FT_RUN = [*tiny_model(), "seq_len=32", "micro_batch_size=2", "metrics.console=false", "metrics.tensorboard=false",
          "eval_batches=1", "fault_tolerance.enable=true", "fault_tolerance.timeout_s=20"]


# With the kill injection: EMBER_TEST_PAUSE_AT_STEP=N holds a group at its quorum for step N + 1 until the file
# $EMBER_TEST_MARKER exists, which a group started with EMBER_TEST_MARK_QUORUM=1 creates at its first quorum: the
# survivors wait there for the restarted group, however fast or slow this machine runs their steps.
PAUSE_INJECTION = KILL_INJECTION + """
if os.environ.get("EMBER_TEST_MARKER"):
    import pathlib
    import time
    import ember.train.fault_tolerance as ft
    marker = pathlib.Path(os.environ["EMBER_TEST_MARKER"])
    pause_at = int(os.environ.get("EMBER_TEST_PAUSE_AT_STEP", -1))
    original_quorum = ft.ReplicaGroups._quorum
    def quorum(self):
        if os.environ.get("EMBER_TEST_MARK_QUORUM"):
            marker.touch()
        elif self.manager.current_step() == pause_at:
            while not marker.exists():
                time.sleep(0.05)
        return original_quorum(self)
    ft.ReplicaGroups._quorum = quorum
"""


def _lighthouse(min_groups: int):
    """torchft's lighthouse on a free port, forming quorums of `min_groups` or more; stopped by pid at the end."""
    from ember.launch.replica_groups import _free_port

    port = _free_port()
    proc = subprocess.Popen(ft.lighthouse_command(port, min_groups, join_timeout_ms=2000),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    assert proc.poll() is None, "the lighthouse did not start"
    yield f"http://127.0.0.1:{port}"
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)


@pytest.fixture
def lighthouse():
    yield from _lighthouse(1)


@pytest.fixture
def lighthouse_of_two():
    """A quorum needs both groups: two groups that start at different times still meet at every sync."""
    yield from _lighthouse(2)


@pytest.mark.parametrize("overrides, message", [
    (["fault_tolerance.replica_groups=0"], "fault_tolerance.replica_groups must be >= 1"),
    (["fault_tolerance.replica_groups=2", "fault_tolerance.min_replica_groups=3"],
     "fault_tolerance.min_replica_groups=3 must be in [1, fault_tolerance.replica_groups=2]"),
    (["fault_tolerance.semi_sync=streaming"], "fault_tolerance.semi_sync='streaming': choose one of none, diloco"),
    (["fault_tolerance.semi_sync=diloco", "fault_tolerance.diloco.sync_steps=0"],
     "fault_tolerance.diloco.sync_steps must be >= 1"),
    (["fault_tolerance.replica_groups=3", "global_batch_size=4", "micro_batch_size=2"],
     "global_batch_size=4 is not divisible by micro_batch_size x data-parallel size (over "
     "fault_tolerance.replica_groups) = 2 x 3 = 6"),
    (["device=xla"], "fault_tolerance.enable=true runs on the torch engine"),
])
def test_bad_fault_tolerance_settings_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config("debug", ["fault_tolerance.enable=true", *overrides], world_size=1)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_group_without_its_environment_is_told_what_to_set(tmp_path):
    result = run_ember("train", "debug", *FT_RUN, "fault_tolerance.replica_groups=2", "global_batch_size=4",
                       f"output_dir={tmp_path / 'run'}", env=job_env())
    assert result.returncode == 2
    assert "$EMBER_REPLICA_GROUP must name this process's replica group, 0..1" in result.stderr
    assert "ember launch local --replica-groups R" in result.stderr
    assert not (tmp_path / "run").exists()


def test_the_healing_state_round_trips_into_a_peers_tensors():
    """local_tensors on one side, copy_into on the other: every tensor overwritten in place, other values taken."""
    mine = {"weights": {"w": torch.zeros(3), "opt": {"step": torch.tensor(0.0), "lr": 0.1}}, "train": {"step": 0}}
    peer = {"weights": {"w": torch.arange(3.0), "opt": {"step": torch.tensor(7.0), "lr": 0.05}}, "train": {"step": 7}}
    w = mine["weights"]["w"]
    out = ft.copy_into(mine, ft.local_tensors(peer))
    assert out["weights"]["w"] is w and w.tolist() == [0.0, 1.0, 2.0]
    assert out["weights"]["opt"]["lr"] == 0.05 and out["train"]["step"] == 7
    with pytest.raises(RuntimeError, match="same model, layout and optimizer"):
        ft.copy_into(mine, {"weights": {"w": torch.zeros(3)}, "train": {"step": 1}})


def _group(group: int, lighthouse: str, run: Path, steps: int, extra: list[str], env: dict) -> subprocess.Popen:
    env = dict(env, EMBER_REPLICA_GROUP=str(group), TORCHFT_LIGHTHOUSE=lighthouse)
    return subprocess.Popen([sys.executable, "-m", "ember", "train", "debug", *FT_RUN, f"max_steps={steps}",
                             f"output_dir={run}", *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _stop(procs) -> None:
    """Whatever a failed test left running."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _run_groups(lighthouse: str, run: Path, steps: int, extra: list[str], groups: int = 2) -> None:
    """Every group of a run started together and run to its end, each succeeding."""
    procs = [_group(g, lighthouse, run, steps, extra, job_env()) for g in range(groups)]
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=900)
            assert proc.returncode == 0, err[-3000:]
    finally:
        _stop(procs)


def _final_weights(run: Path) -> dict[str, torch.Tensor]:
    from ember.model_io.load import load_model

    return load_model(run).state_dict()


@pytest.mark.slow
def test_a_killed_group_heals_from_its_peers_while_they_train_on(tmp_path, lighthouse):
    """3 groups of 1 rank (a step needs 2 of them: no group trains alone); group 1 is killed (SIGKILL) at step 4 and
    started again: the other two never restart, the steps without it are recorded with the groups whose data they
    consumed, and after healing group 1's weights equal the others' bit for bit."""
    run, steps, pause = tmp_path / "run", 16, 9
    extra = ["fault_tolerance.replica_groups=3", "fault_tolerance.min_replica_groups=2", "global_batch_size=6",
             "logging_steps=1"]
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(PAUSE_INJECTION)
    env = job_env(PYTHONPATH=f"{inject}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                  EMBER_TEST_MARKER=str(tmp_path / "rejoined"))
    survivors = dict(env, EMBER_TEST_PAUSE_AT_STEP=str(pause))
    groups = {g: _group(g, lighthouse, run, steps, extra, survivors if g != 1 else dict(env, EMBER_KILL_AT_STEP="4"))
              for g in range(3)}
    try:
        killed = groups[1].wait(timeout=600)
        assert killed == -signal.SIGKILL, groups[1].communicate()[1][-3000:]
        assert groups[0].poll() is None and groups[2].poll() is None, "the survivors stopped"
        groups[1] = _group(1, lighthouse, run, steps, extra, dict(env, EMBER_TEST_MARK_QUORUM="1"))
        outputs = {g: proc.communicate(timeout=900) for g, proc in groups.items()}
    finally:
        _stop(groups.values())
    for g, proc in groups.items():
        assert proc.returncode == 0, outputs[g][1][-3000:]
    records = read_records(run)
    # a step without a group is recorded by the groups that ran it: steps 5..9 by groups 0 and 2, and step 10 too
    # where their quorum for it formed before group 1 asked (torchft may then leave one of them out of it instead)
    degraded = {r["step"]: r for d in ("", "replica-group-1", "replica-group-2") for r in read_records(run / d)
                if "replica_groups" in r}
    assert sorted(degraded) in (list(range(5, pause + 1)), list(range(5, pause + 2))), sorted(degraded)
    assert all(degraded[s]["replica_groups"] == [0, 2] for s in range(5, pause + 1))
    assert all(r["replica_groups_missing"] == 1 and r["tokens"] == 4 * 32 for r in degraded.values())
    healed_at = max(degraded)
    assert "replica group 1: healed from a live peer at step" in outputs[1][0]
    for g in (0, 2):  # one process each from start to end, never resumed (torchft may still copy a peer's state
        # to one whose commit failed or that missed a step)
        assert "resumed from" not in outputs[g][0]
    assert max(r["step"] for r in records if "loss" in r) == steps
    # tokens seen: every step's 6 rows of 32 tokens, less a missing group's 2 rows in each step without it
    assert [r["tokens_seen"] for r in records if "tokens_seen" in r][-1] == steps * 6 * 32 - len(degraded) * 2 * 32
    healed = read_records(run / "replica-group-1")
    assert min(r["step"] for r in healed if "loss" in r) in (healed_at, healed_at + 1)  # no step replayed
    weights = [_final_weights(run if g == 0 else run / f"replica-group-{g}") for g in range(3)]
    for g in (1, 2):
        assert weights[g].keys() == weights[0].keys()
        assert all(torch.equal(weights[g][k], weights[0][k]) for k in weights[0]), f"group {g} differs"


def test_diloco_outer_step_equals_the_hand_computed_one(lighthouse_of_two, monkeypatch):
    """Two groups (threads, each its own torchft manager and store) train a linear layer with DiLoCo (2 inner SGD
    steps on their own data, outer SGD lr 0.7 without momentum): after the sync both hold
    w0 - 0.7 (w0 - mean(w_g)), with w_g each group's weights after its inner steps, computed here by hand."""
    from concurrent.futures import ThreadPoolExecutor

    from ember.config_schema import DiLoCoConfig, FaultToleranceConfig

    monkeypatch.setenv(ft.LIGHTHOUSE_ENV, lighthouse_of_two)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    cfg = FaultToleranceConfig(enable=True, replica_groups=2, timeout_s=30, semi_sync="diloco",
                               diloco=DiLoCoConfig(sync_steps=2, outer_lr=0.7, outer_momentum=0.0, nesterov=False))
    torch.manual_seed(0)
    w0 = torch.randn(3, 4)
    data = [[torch.randn(5, 4) for _ in range(2)] for _ in range(2)]

    def inner(w: torch.Tensor, batches: list[torch.Tensor]) -> torch.Tensor:  # SGD lr 0.1 on mean(x @ w.T) ** 2
        w = w.clone().requires_grad_(True)
        for x in batches:
            loss = (x @ w.T).pow(2).mean()
            (grad,) = torch.autograd.grad(loss, w)
            w = (w - 0.1 * grad).detach().requires_grad_(True)
        return w.detach()

    def group(g: int) -> torch.Tensor:
        model = torch.nn.Linear(4, 3, bias=False)
        with torch.no_grad():
            model.weight.copy_(w0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        replicas = ft.ReplicaGroups(cfg, g, 0, 1, torch.device("cpu"))
        replicas.manager.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
        try:
            context, _ = ft.diloco(replicas, model, optimizer)  # (entered)
            for x in data[g]:
                (x @ model.weight.T).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
            context.__exit__(None, None, None)
            return model.weight.detach().clone()
        finally:
            replicas.close()

    with ThreadPoolExecutor(2) as pool:
        synced = list(pool.map(group, range(2)))
    mean = (inner(w0, data[0]) + inner(w0, data[1])) / 2
    expected = w0 - 0.7 * (w0 - mean)
    assert torch.equal(synced[0], synced[1])
    torch.testing.assert_close(synced[0], expected, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_a_diloco_run_over_two_groups_trains_and_ends_with_one_model(tmp_path, lighthouse_of_two):
    from ember.model_io.load import load_model

    run = tmp_path / "run"
    extra = ["fault_tolerance.replica_groups=2", "global_batch_size=4", "fault_tolerance.semi_sync=diloco",
             "fault_tolerance.diloco.sync_steps=4", "logging_steps=1"]
    _run_groups(lighthouse_of_two, run, 12, extra)
    weights = [load_model(d).state_dict() for d in (run, run / "replica-group-1")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0]), "the groups differ after the sync"
    losses = [r["loss"] for r in read_records(run) if "loss" in r]
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3])


@pytest.mark.slow
def test_launch_local_starts_the_lighthouse_and_every_group(tmp_path):
    run = tmp_path / "run"
    result = run_ember("launch", "local", "--replica-groups", "2", "debug", *FT_RUN[:-2], "global_batch_size=4",
                       "max_steps=3", f"output_dir={run}", env=job_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "lighthouse: http://127.0.0.1:" in result.stderr
    for g in range(2):
        assert f"replica group {g}: 1 rank, pid " in result.stderr
        assert (run / "logs" / f"replica-group-{g}.log").is_file()
    assert (run / "checkpoints" / "step-3" / "model.json").is_file()
    assert (run / "replica-group-1" / "checkpoints" / "step-3" / "model.json").is_file()
    assert max(r["step"] for r in read_records(run) if "loss" in r) == 3


def test_launch_flags_for_replica_groups_are_checked():
    for argv, message in [(["--replica-groups", "0"], "--replica-groups must be >= 1"),
                          (["--max-restarts", "2"], "--max-restarts restarts replica groups: give --replica-groups"),
                          (["--replica-groups", "2", "--max-restarts", "x"], "--max-restarts must be an integer"),
                          (["--replica-groups", "2", "debug", "fault_tolerance.replica_groups=3"],
                           "--replica-groups 2 contradicts fault_tolerance.replica_groups=3")]:
        result = run_ember("launch", "local", *argv, env=job_env())
        assert result.returncode == 2 and message in result.stderr, (argv, result.stderr)


@pytest.mark.slow
def test_two_groups_of_two_fsdp_ranks_train_like_hsdp_bit_for_bit(tmp_path):
    """`ember launch local --replica-groups 2 --nproc-per-node 2` with fsdp=2 in each group against one job of 4
    ranks with ici_mesh.data=2 x fsdp=2 (HSDP: the same shards, the same data per rank, the same two-way average of
    the same reduce-scattered shards): equal gradient norms and final weights, bit for bit. The logged loss is
    averaged in another order (over the groups, then within; HSDP all-reduces it once), so within one float32 ulp."""
    from ember.model_io.load import load_model

    base = ["debug", *tiny_model(), "seq_len=32", "global_batch_size=8", "micro_batch_size=2", "metrics.console=false",
            "metrics.tensorboard=false", "eval_batches=1", "max_steps=6", "logging_steps=1", "precision=fp32"]
    run_ember("train", "--nproc-per-node", "4", *base, "ici_mesh.data=2", "ici_mesh.fsdp=2",
              f"output_dir={tmp_path / 'hsdp'}", env=job_env(), expect=0)
    run_ember("launch", "local", "--replica-groups", "2", "--nproc-per-node", "2", *base, "ici_mesh.fsdp=2",
              f"output_dir={tmp_path / 'groups'}", env=job_env(), expect=0)
    runs = [tmp_path / "hsdp", tmp_path / "groups", tmp_path / "groups" / "replica-group-1"]
    logged = [{r["step"]: (r["loss"], r["grad_norm"]) for r in read_records(run) if "loss" in r} for run in runs]
    for other in logged[1:]:
        assert other.keys() == logged[0].keys() == set(range(1, 7))
        for step, (loss, norm) in logged[0].items():
            assert other[step][1] == norm
            assert other[step][0] == pytest.approx(loss, rel=2e-7)
    weights = [load_model(run).state_dict() for run in runs]
    for other in weights[1:]:
        assert all(torch.equal(other[k], weights[0][k]) for k in weights[0])


@pytest.mark.slow
def test_a_group_that_starts_late_is_waited_for(tmp_path, lighthouse):
    """torchft's lighthouse forms a quorum of the groups that are up: group 0, started alone, waits at its first
    quorum for group 1 (fault_tolerance.quorum_timeout_s) instead of training alone, so no step runs without it."""
    run = tmp_path / "run"
    extra = ["fault_tolerance.replica_groups=2", "global_batch_size=4", "logging_steps=1",
             "metrics.console=true"]
    first = _group(0, lighthouse, run, 6, extra, job_env())
    procs = [first]
    try:
        while "ember train" not in first.stdout.readline():  # its header: the model is built, the loop next
            assert first.poll() is None, first.communicate()[1][-3000:]
        time.sleep(3)
        procs.append(_group(1, lighthouse, run, 6, extra, job_env()))
        outputs = [proc.communicate(timeout=900) for proc in procs]
    finally:
        _stop(procs)
    assert [proc.returncode for proc in procs] == [0, 0], outputs[0][1][-3000:]
    records = read_records(run)
    assert not [r for r in records if "replica_groups" in r]  # no step without group 1
    assert [r["tokens_seen"] for r in records if "tokens_seen" in r][-1] == 6 * 4 * 32
    weights = [_final_weights(d) for d in (run, run / "replica-group-1")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


@pytest.mark.slow
def test_a_group_that_starts_after_the_others_finished_stops_instead_of_training_alone(tmp_path, lighthouse):
    """A cluster too small for every group at once: group 1 starts once group 0 has finished (after its timeout,
    alone). It is refused in one line before any step, instead of training alone to other weights."""
    run = tmp_path / "run"
    extra = ["fault_tolerance.replica_groups=2", "global_batch_size=4", "fault_tolerance.quorum_timeout_s=3"]
    first = _group(0, lighthouse, run, 3, extra, job_env())
    assert first.wait(timeout=600) == 0, first.communicate()[1][-3000:]
    late = _group(1, lighthouse, run, 3, extra, job_env())
    _, err = late.communicate(timeout=600)
    assert late.returncode == 2, err[-3000:]
    assert "replica group(s) [0] already finished this run (a checkpoint at max_steps=3 in their run directories): " \
           "group 1 would train without them" in err and f"their model: {run})" in err
    assert not [r for r in read_records(run / "replica-group-1") if "loss" in r]


def test_diloco_saves_and_ends_only_at_a_sync():
    for key in ("max_steps=42", "checkpoint.interval=12"):
        with pytest.raises(ConfigError, match=f"{key} is not a multiple of fault_tolerance.diloco.sync_steps=5"):
            load_config("debug", ["fault_tolerance.enable=true", "fault_tolerance.semi_sync=diloco",
                                  "fault_tolerance.diloco.sync_steps=5", "max_steps=40", key], world_size=1)


@pytest.mark.slow
@pytest.mark.parametrize("semi_sync", ["none", "diloco"])
def test_a_whole_job_restart_resumes_every_group_bit_for_bit(tmp_path, lighthouse, semi_sync):
    """Two groups stopped at step 4 and started again to 6 equal two groups run to 6 in one go: each group resumes
    its own checkpoint, and the losses, gradient norms and final weights are those of the uninterrupted run. With
    DiLoCo (a sync every 2 steps), the outer optimizer's momentum comes back too."""
    extra = ["fault_tolerance.replica_groups=2", "global_batch_size=4", "logging_steps=1",
             f"fault_tolerance.semi_sync={semi_sync}", "fault_tolerance.diloco.sync_steps=2"]

    _run_groups(lighthouse, tmp_path / "straight", 6, extra)
    _run_groups(lighthouse, tmp_path / "resumed", 4, extra)
    _run_groups(lighthouse, tmp_path / "resumed", 6, extra)
    for group in ("", "replica-group-1"):
        logged = [{r["step"]: (r["loss"], r["grad_norm"]) for r in read_records(tmp_path / run / group) if "loss" in r}
                  for run in ("straight", "resumed")]
        assert logged[0] == logged[1] and len(logged[0]) == 6
        weights = [_final_weights(tmp_path / run / group) for run in ("straight", "resumed")]
        assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
