"""A real SLURM cluster of two (or more) nodes on this machine, for the launch tests: munged, slurmctld and one
slurmd per node, started in a temporary directory and stopped by pid. Debian's slurm-wlm and munge (22.05) need no
systemd; the facts below were measured:
- munged refuses a socket directory that is not world-executable unless given -f;
- client commands find the cluster through SLURM_CONF;
- the machine's hostname is not the node name, so each slurmd starts with -N NODE; the nodes share
  127.0.0.1 on their own ports, and their names do not resolve (jobs take addresses from scontrol).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel")
CPUS_PER_NODE = 2


class SlurmUnavailable(RuntimeError):
    """slurm or munge is not installed or would not start: the SLURM tests fail with this, never skip."""


def _free_port_range(count: int) -> int:
    """A port p with p .. p + count - 1 all free (the slurmds' Port=[p-(p+count-1)] range)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            for offset in range(1, count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + offset))
            return port
        except OSError:
            continue
    raise SlurmUnavailable(f"no {count} consecutive free ports for the slurmds")


def _first_job_id() -> int:
    """Each pytest-xdist worker's cluster numbers its jobs from its own thousand: a job's rendezvous port and id
    come from its job id (ember/launch/slurm.py), and two clusters on one machine numbering from 1 would put their
    concurrent jobs on one c10d store."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    return 1000 * (1 + index % 19)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SLURM_CONF = """\
ClusterName=ember-test
FirstJobId={first_job_id}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={dir}/munge.socket,cred_expire=10
CredType=cred/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool-%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
MailProg=/bin/true
PlugStackConfig={dir}/plugstack.conf
KillWait=30
InactiveLimit=0
MinJobAge=300
NodeName=node[1-{nodes}] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[{node_port}-{node_port_end}] CPUs={cpus} \
State=UNKNOWN
PartitionName=debug Nodes=node[1-{nodes}] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


class SlurmCluster:
    """start() writes the config and starts the daemons; stop() ends them by pid. `env` is what a client
    command (sbatch, ember launch slurm) needs to reach this cluster."""

    def __init__(self, root: Path, nodes: int = 2):
        self.root = Path(root)
        self.nodes = tuple(f"node{i}" for i in range(1, nodes + 1))
        self.conf = self.root / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        self.pids: list[int] = []
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    def start(self) -> "SlurmCluster":
        missing = [name for name in DAEMONS if shutil.which(name) is None and not Path("/usr/sbin", name).exists()]
        if missing:
            raise SlurmUnavailable(f"not installed: {', '.join(missing)} (apt-get install -y slurm-wlm munge)")
        self.root.mkdir(parents=True, exist_ok=True)
        for sub in ("state", *(f"spool-{node}" for node in self.nodes)):
            (self.root / sub).mkdir(exist_ok=True)
        (self.root / "plugstack.conf").write_text("")
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        node_port = _free_port_range(len(self.nodes))
        self.conf.write_text(SLURM_CONF.format(host=socket.gethostname(), ctld_port=_free_port(), dir=self.root,
                                               node_port=node_port, node_port_end=node_port + len(self.nodes) - 1,
                                               cpus=CPUS_PER_NODE, nodes=len(self.nodes),
                                               first_job_id=_first_job_id()))
        sbin = lambda name: shutil.which(name) or f"/usr/sbin/{name}"  # noqa: E731
        # -F: in the foreground, so the pid is ours to stop; -f: the temporary directory's permissions are ours
        self._spawn([sbin("munged"), "-F", "-f", f"--socket={self.root}/munge.socket", f"--key-file={key}",
                     f"--pid-file={self.root}/munged.pid", f"--log-file={self.root}/munged.log",
                     f"--seed-file={self.root}/munged.seed"], "munged")
        self._wait_for(lambda: (self.root / "munge.socket").exists(), "munged")
        self._spawn([sbin("slurmctld"), "-D", "-f", str(self.conf)], "slurmctld")
        for node in self.nodes:
            self._spawn([sbin("slurmd"), "-D", "-N", node, "-f", str(self.conf)], f"slurmd-{node}")
        self._wait_for(self._nodes_idle, f"the {len(self.nodes)} slurmd nodes to be idle", timeout=300)
        return self

    def _spawn(self, argv: list[str], name: str) -> None:
        log = open(self.root / f"{name}.stdout", "wb")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        log.close()
        self.procs.append(proc)

    def _wait_for(self, ready, what: str, timeout: float = 120.0) -> None:
        # The timeout only bounds a hang (a daemon that exits is reported at once): on a loaded machine they are slow.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise SlurmUnavailable(f"{proc.args[0]} exited ({proc.returncode}) while waiting for {what}: "
                                           + self.logs())
            if ready():
                return
            time.sleep(0.1)
        raise SlurmUnavailable(f"timed out waiting for {what}: " + self.logs())

    def _nodes_idle(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True)
        states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
        return out.returncode == 0 and all(states.get(node) == "idle" for node in self.nodes)

    def logs(self) -> str:
        parts = []
        for path in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.stdout")):
            text = path.read_text(errors="replace")[-2000:]
            if text.strip():
                parts.append(f"--- {path.name}\n{text}")
        return "\n".join(parts)

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True, check=check)

    def _job_processes(self) -> list[int]:
        """Every process of this cluster: the daemons, and the jobs' (which inherit SLURM_CONF from the submitting
        environment or from their slurmd)."""
        mine, pids = f"SLURM_CONF={self.conf}".encode(), []
        for environ in Path("/proc").glob("[0-9]*/environ"):
            try:
                if mine in environ.read_bytes().split(b"\0") and int(environ.parent.name) != os.getpid():
                    pids.append(int(environ.parent.name))
            except OSError:  # ended meanwhile, or not ours to read
                continue
        return pids

    def stop(self) -> None:
        # Jobs first (their steps are the slurmds' children), then the daemons, newest first, by pid; then whatever
        # a job left behind (a step's processes outlive a stopped slurmd and would hold their ports).
        if any(proc.poll() is None for proc in self.procs):
            subprocess.run(["scancel", "--user=root"], env=self.env, capture_output=True)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and self.run("squeue", "-h", check=False).stdout.strip():
                time.sleep(0.5)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []
        for pid in self._job_processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
