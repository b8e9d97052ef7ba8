"""`ember launch local --replica-groups R ...` (and `ember train --replica-groups R`): a fault-tolerant job on this
machine. torchft's lighthouse, then R replica groups, each its own torchrun of `ember train` (--nproc-per-node ranks,
restarted by torchrun up to --max-restarts times after a failure: the restarted group resumes its own checkpoint and
heals from a live peer), with fault_tolerance.enable=true and the group in $EMBER_REPLICA_GROUP
(ember/train/fault_tolerance.py). One line says where the lighthouse and each group are; each group's output goes to
OUTPUT_DIR/logs/replica-group-G.log. The launcher waits for every group, then stops the lighthouse.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ember.errors import ConfigError
from ember.train.fault_tolerance import GROUP_ENV, LIGHTHOUSE_ENV, lighthouse_command

DEFAULT_MAX_RESTARTS = 3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def group_overrides(overrides: list[str], groups: int) -> list[str]:
    """The job's overrides with fault tolerance on over `groups` groups; a contradicting one is refused."""
    given = {item.partition("=")[0]: item.partition("=")[2] for item in overrides}
    if given.get("fault_tolerance.replica_groups", str(groups)) != str(groups):
        raise ConfigError(f"--replica-groups {groups} contradicts fault_tolerance.replica_groups="
                          f"{given['fault_tolerance.replica_groups']}; give one of them")
    if given.get("fault_tolerance.enable", "true").lower() != "true":
        raise ConfigError("--replica-groups starts a fault-tolerant job: drop fault_tolerance.enable=false")
    return [*overrides, "fault_tolerance.enable=true", f"fault_tolerance.replica_groups={groups}"]


def launch_replica_groups(recipe_argv: list[str], output_dir: str, run_dir: Path, groups: int, nproc: int,
                          max_restarts: int, min_groups: int) -> int:
    """Start the lighthouse and the groups (`recipe_argv`: RECIPE and the overrides, fault tolerance already on;
    `run_dir`: the run's local directory, for the logs), wait for them, stop the lighthouse. The lighthouse forms a
    quorum of at least `min_groups` (fault_tolerance.min_replica_groups) groups."""
    if shutil.which("torchft_lighthouse") is None:
        raise ConfigError("--replica-groups needs torchft's lighthouse: pip install -e '.[ft]'")
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    lighthouse = subprocess.Popen(lighthouse_command(port, min_groups), stdout=subprocess.DEVNULL,
                                  stderr=open(logs / "lighthouse.log", "ab"), start_new_session=True)
    address = f"http://127.0.0.1:{port}"
    print(f"lighthouse: {address} (pid {lighthouse.pid}, log {logs / 'lighthouse.log'})", file=sys.stderr)
    procs: list[subprocess.Popen] = []
    stopped: list[int] = []  # a signal to the launcher, passed on to every group (each saves and exits)

    def pass_on(signum: int, _frame: object) -> None:
        stopped.append(signum)
        for proc in procs:
            proc.send_signal(signum)

    handlers = {sig: signal.signal(sig, pass_on) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        time.sleep(0.5)  # the lighthouse binds before the groups ask it for a quorum
        if lighthouse.poll() is not None:
            raise ConfigError(f"the torchft lighthouse exited at once (code {lighthouse.returncode}); see "
                              f"{logs / 'lighthouse.log'}")
        for group in range(groups):
            env = dict(os.environ, **{GROUP_ENV: str(group), LIGHTHOUSE_ENV: address})
            env.setdefault("RUST_LOG", "warn")  # torchft logs every quorum and commit at INFO
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // (nproc * groups))))
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                    "--max-restarts", str(max_restarts), "-m", "ember", "train", *recipe_argv]
            log = logs / f"replica-group-{group}.log"
            procs.append(subprocess.Popen(argv, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                                          start_new_session=True))
            print(f"replica group {group}: {nproc} rank{'s' if nproc > 1 else ''}, pid {procs[-1].pid}, log {log}",
                  file=sys.stderr)
        codes = [proc.wait() for proc in procs]
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        lighthouse.terminate()
        lighthouse.wait()
    if stopped:
        name = signal.Signals(stopped[0]).name
        print(f"stopped by {name}: passed on to every group (each saves a checkpoint at its next step and exits; "
              f"the same command resumes); logs in {logs}", file=sys.stderr)
        return 130 if stopped[0] == signal.SIGINT else 0
    failed = [(g, code) for g, code in enumerate(codes) if code != 0]
    for group, code in failed:
        print(f"error: replica group {group} exited with code {code}; see {logs / f'replica-group-{group}.log'}",
              file=sys.stderr)
    if not failed:
        print(f"done: {groups} replica groups; see the run: ember report {output_dir}", file=sys.stderr)
    return 1 if failed else 0
