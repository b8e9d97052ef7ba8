"""`ember launch slurm --replica-groups R`: a fault-tolerant job on SLURM (fault_tolerance.*, ember/train/
fault_tolerance.py). Two jobs:
- JOB_NAME-lighthouse: torchft's lighthouse on one CPU of one node. It writes its address to
  OUTPUT_DIR/launch/JOB_NAME.lighthouse and runs until the groups' job has left the queue.
- JOB_NAME: a job array with one task per replica group, each the usual multi-node torchrun job (slurm.py) with
  $EMBER_REPLICA_GROUP = its task id and $TORCHFT_LIGHTHOUSE read from that file. It starts once the lighthouse
  has (--dependency=after). Each task is its own SLURM job: cancelling, requeueing or losing the node of one leaves
  the others training; a requeued task resumes its own checkpoint and heals from a live peer.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Callable, Optional

from ember.errors import EmberError
from ember.train.fault_tolerance import GROUP_ENV, LIGHTHOUSE_ENV, lighthouse_command

GROUP_NAMES = (GROUP_ENV, LIGHTHOUSE_ENV)  # what a group's processes read, forwarded into a container
ADDRESS_WAIT_S = 600  # how long a group waits for the lighthouse's address (it is written ~2 s after its start)
REUSE_NOTE = ("# One task per replica group, started after its lighthouse job ({name}-lighthouse.sbatch): resubmit "
              "both with the\n# same `ember launch slurm ... --replica-groups R` (each group resumes its own "
              "checkpoint).")
# squeue states of a job still on its way (a requeued task passes through REQUEUED on its way to PENDING)
LIVE_STATES = {"PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
               "RESIZING", "SUSPENDED", "STAGE_OUT", "SIGNALING", "STOPPED"}


def lighthouse_file(output_dir: Path, job_name: str) -> Path:
    """Where the lighthouse job writes `http://ADDR:PORT JOBID` for the groups to read."""
    return output_dir / "launch" / f"{job_name}.lighthouse"


def groups_file(output_dir: Path, job_name: str) -> Path:
    """Where the submission writes the groups' job id, which the lighthouse watches."""
    return output_dir / "launch" / f"{job_name}.groups-job"


def group_lines(groups: int, address_file: Path) -> list[str]:
    """The lines of a group's script (one array task) that set its group and the lighthouse's address."""
    quoted = shlex.quote(str(address_file))
    return [
        f"# Replica group $SLURM_ARRAY_TASK_ID of {groups} (fault_tolerance): the lighthouse job writes its address",
        "# into the file below once it runs; this job starts after it (--dependency=after).",
        f'export {GROUP_ENV}="$SLURM_ARRAY_TASK_ID"',
        f"for _ in $(seq {ADDRESS_WAIT_S}); do [ -s {quoted} ] && break; sleep 1; done",
        f'[ -s {quoted} ] || {{ echo "ember: no lighthouse address in {address_file} after {ADDRESS_WAIT_S} s: '
        'is its lighthouse job running? (ember launch status LIGHTHOUSE_JOB)"; exit 1; }',
        f"export {LIGHTHOUSE_ENV}=\"$(cut -d' ' -f1 {quoted})\"",
        f'echo "ember: replica group ${GROUP_ENV} of {groups}, lighthouse ${LIGHTHOUSE_ENV}"',
        "",
    ]


def render_lighthouse(job_name: str, output_dir: Path, workdir: Path, min_groups: int, partition: Optional[str],
                      account: Optional[str], qos: Optional[str], time_limit: Optional[str],
                      command_line: str = "") -> str:
    """The lighthouse job's script: one CPU, on `partition` (a CPU partition keeps it off the GPU nodes)."""
    address_file, groups_job = lighthouse_file(output_dir, job_name), groups_file(output_dir, job_name)
    sbatch = [f"--job-name={job_name}-lighthouse", "--nodes=1", "--ntasks=1", "--cpus-per-task=1",
              f"--output={output_dir}/logs/%x-%j.out", "--open-mode=append", f"--chdir={workdir}"]
    for flag, value in (("partition", partition), ("time", time_limit), ("account", account), ("qos", qos)):
        if value:
            sbatch.append(f"--{flag}={value}")
    argv = lighthouse_command(0, min_groups)
    argv[-1] = "[::]:${port}"
    lines = [
        "#!/bin/bash",
        f"# Written by `ember launch slurm --replica-groups` on {datetime.now().isoformat(timespec='seconds')}"
        + (f":\n#   {command_line}" if command_line else "."),
        f"# torchft's lighthouse for the replica groups of {job_name}.sbatch: it forms each step's quorum of groups",
        f"# (at least {min_groups}: fault_tolerance.min_replica_groups). It runs until the groups' job has left the "
        "queue.",
        *[f"#SBATCH {option}" for option in sbatch],
        "",
        "set -uo pipefail",
        f"address_file={shlex.quote(str(address_file))}",
        f"groups_job_file={shlex.quote(str(groups_job))}",
        'node_addr=$(scontrol show node "$SLURMD_NODENAME" | sed -n \'s/.*NodeAddr=\\([^ ]*\\).*/\\1/p\')',
        "port=$((20000 + SLURM_JOB_ID % 20000))",
        "RUST_LOG=${RUST_LOG:-warn} " + " ".join(f'"{a}"' if "$" in a else shlex.quote(a) for a in argv) + " &",
        "lighthouse_pid=$!",
        'trap \'kill "$lighthouse_pid" 2>/dev/null; rm -f "$address_file"\' EXIT',
        "trap 'exit 0' TERM INT",
        "sleep 2",
        'kill -0 "$lighthouse_pid" 2>/dev/null || { echo "ember: the lighthouse exited at once"; exit 1; }',
        'echo "http://${node_addr:-$(hostname)}:$port $SLURM_JOB_ID" > "$address_file.tmp"',
        'mv "$address_file.tmp" "$address_file"',
        'echo "ember: lighthouse http://${node_addr:-$(hostname)}:$port (job $SLURM_JOB_ID) at $(date -Is)"',
        "",
        "# The groups' job id is written at submission. Its tasks are in the queue (pending, running or requeued)",
        "# until every group has ended; then the lighthouse's work is done.",
        'while kill -0 "$lighthouse_pid" 2>/dev/null; do',
        "  sleep 5 & wait $!",
        '  [ -s "$groups_job_file" ] || continue',
        '  if ! states=$(squeue -h -t all -j "$(cat "$groups_job_file")" -o %T 2>&1); then',
        '    echo "$states" | grep -qi "invalid job id" || continue  # (the controller did not answer: ask again)',
        f'  elif echo "$states" | grep -qE "^({"|".join(sorted(LIVE_STATES))})$"; then',
        "    continue",
        "  fi",
        '  echo "ember: the replica groups have ended; stopping the lighthouse at $(date -Is)"',
        "  exit 0",
        "done",
        'echo "ember: the lighthouse exited"',
        "exit 1",
        "",
    ]
    return "\n".join(lines)


def _queued_states(job_id: str) -> list[str]:
    proc = subprocess.run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"], capture_output=True, text=True)
    return [state for state in proc.stdout.split() if state in LIVE_STATES] if proc.returncode == 0 else []


def check_capacity(partition: Optional[str], lighthouse_partition: Optional[str], groups: int, nodes: int) -> None:
    """Every group must be able to run at once (each is --exclusive; the lighthouse holds a node of its partition):
    a group that can only start once others have ended trains with no one. Refused in one line when the partition
    has fewer nodes; unknown sizes (sinfo unavailable) are not guessed at."""
    def size(name: Optional[str]) -> Optional[int]:
        try:
            proc = subprocess.run(["sinfo", "-h", "-o", "%D %P", *(["-p", name] if name else [])],
                                  capture_output=True, text=True)
        except FileNotFoundError:  # not on a SLURM machine: sbatch says so next
            return None
        rows = [line.split() for line in proc.stdout.splitlines() if line.strip()]
        if proc.returncode or not rows:
            return None
        default = [r for r in rows if r[1].endswith("*")]  # sinfo marks the default partition with *
        return sum(int(r[0]) for r in (rows if name else default or rows))

    have = size(partition)
    shared = lighthouse_partition in (None, partition)
    need = groups * nodes + (1 if shared else 0)
    if have is not None and need > have:
        where = f"partition {partition}" if partition else "the default partition"
        raise EmberError(f"{groups} replica groups of {nodes} node(s) {'and the lighthouse ' if shared else ''}need "
                         f"{need} nodes at once, and {where} has {have}: a group that starts only after the others "
                         "ended has no one to train with. Use fewer groups or nodes per group"
                         + (", or put the lighthouse on another partition (--lighthouse-partition)" if shared else ""))


def submit_groups(lighthouse_script: Path, groups_script: Path, output_dir: Path, job_name: str,
                  submit: Callable[..., str]) -> tuple[str, str]:
    """Submit the lighthouse, then the groups' array after it; (lighthouse job id, groups' job id). A run whose
    groups are still in the queue is refused: two submissions would write the same run directories."""
    previous = groups_file(output_dir, job_name)
    if previous.is_file() and _queued_states(previous.read_text().strip()):
        job = previous.read_text().strip()
        raise EmberError(f"this run's replica groups are still in the queue (job {job}, {previous}): wait for them "
                         f"(ember launch status {job}_0) or cancel them (scancel {job}) before submitting it again")
    for stale in (lighthouse_file(output_dir, job_name), previous):
        stale.unlink(missing_ok=True)  # a previous submission's address or job id
    lighthouse_id = submit(lighthouse_script)
    try:
        groups_id = submit(groups_script, f"--dependency=after:{lighthouse_id}")
    except EmberError:
        subprocess.run(["scancel", lighthouse_id], capture_output=True)
        raise
    path = groups_file(output_dir, job_name)
    path.with_suffix(".tmp").write_text(groups_id + "\n")
    path.with_suffix(".tmp").replace(path)
    return lighthouse_id, groups_id


def task_states(groups_id: str) -> dict[int, dict[str, str]]:
    """The groups' tasks as `scontrol show job -o` tells them: {group: fields} (pending tasks SLURM has not split
    yet appear under each group of their ArrayTaskId range)."""
    from ember.launch.slurm import array_tasks

    tasks: dict[int, dict[str, str]] = {}
    for info in array_tasks(groups_id):
        ids = re.sub(r"%\d+$", "", info.get("ArrayTaskId", ""))
        for part in filter(None, ids.split(",")):
            low, _, high = part.partition("-")
            for group in range(int(low), int(high or low) + 1):
                tasks[group] = info
    return tasks


def wait_groups(lighthouse_id: str, groups_id: str, groups: int, poll_s: float = 2.0,
                out: Callable[[str], None] = lambda s: print(s, flush=True)) -> int:
    """Say each group's state as it changes until none is left in the queue; 0 if every group completed."""
    from ember.launch.slurm import exit_status

    said: dict[int, str] = {}
    tasks: dict[int, dict[str, str]] = {}
    while True:
        tasks = task_states(groups_id) or tasks
        for group, info in sorted(tasks.items()):
            line = (f"replica group {group}: job {groups_id}_{group} {info.get('JobState')}"
                    f" on {info.get('NodeList') or '-'}, restarts {info.get('Restarts', '0')}")
            if said.get(group) != line:
                out(line)
                said[group] = line
        if tasks and all(info.get("JobState") not in LIVE_STATES for info in tasks.values()):
            time.sleep(max(poll_s, 3.0))  # a task that requeues itself looks ended for a moment
            again = task_states(groups_id)
            if all(info.get("JobState") not in LIVE_STATES for info in again.values()):
                tasks = again or tasks
                break
        time.sleep(poll_s)
    failed = {g: exit_status(info) for g, info in tasks.items() if exit_status(info)}
    for group, code in sorted(failed.items()):
        print(f"error: replica group {group} (job {groups_id}_{group}) {tasks[group].get('JobState')} "
              f"(exit code {code}); its log: {tasks[group].get('StdOut')}", file=sys.stderr)
    if not failed:
        print(f"done: {groups} replica groups completed (lighthouse job {lighthouse_id} stops by itself)")
    return max(failed.values(), default=0)
