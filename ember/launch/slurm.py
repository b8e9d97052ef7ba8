"""`ember launch slurm`: an sbatch script that runs the shared torchrun command (command.py) on every node,
handles the preemption warning by saving and requeueing, and is readable and reusable with plain `sbatch`;
plus its submission and the thin `status`, `cancel`, `logs` and `--wait` wrappers over scontrol/scancel.

Tested against a real slurmctld + two slurmds (tests/launch/), not a mock.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Callable, Optional

from ember.errors import ConfigError, EmberError
from ember.launch.command import (
    RDZV_ENDPOINT_ENV,
    RUN_ID_ENV,
    SECRET_NAME,
    TrainJob,
    shell_words,
    split_env,
    torchrun_argv,
)

# Names forwarded into a container when they are set at submission (outside a container the whole submitting
# environment reaches the job: sbatch's default --export=ALL). Values are never written.
FORWARD_NAMES = ("HF_HOME", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "EMBER_CACHE", "WANDB_API_KEY")
FORWARD_PREFIXES = ("NCCL_", "RCCL_", "FI_", "UCX_", "TORCH_NCCL_", "CUDA_", "HIP_")
# JobState values after which the job runs no more (REQUEUED, PENDING, COMPLETING ... are on the way).
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE", "PREEMPTED", "SPECIAL_EXIT", "REVOKED")


@dataclass
class SlurmOptions:
    job_name: str
    partition: Optional[str] = None
    time: Optional[str] = None  # sbatch --time, e.g. 24:00:00
    account: Optional[str] = None
    qos: Optional[str] = None
    gpus_per_node: int = 0  # 0: no GPU request (device=cpu)
    container: Optional[str] = None  # pyxis/enroot image
    mounts: list[str] = field(default_factory=list)  # pyxis SRC:DST
    env: list[str] = field(default_factory=list)  # NAME (forwarded by name) or NAME=VALUE (written)
    signal_seconds: int = 120  # the preemption/time-limit warning: USR1 this long before the end
    extra_sbatch: list[str] = field(default_factory=list)  # more #SBATCH options, verbatim
    replica_groups: int = 0  # > 0: a job array, one task per fault-tolerant replica group (slurm_groups.py)
    max_restarts: int = 0  # torchrun's restarts of a failed rank inside the job (replica groups heal after one)
    group_lines: list[str] = field(default_factory=list)  # replica groups: each task's group and lighthouse
    group_env: list[str] = field(default_factory=list)  # the names those lines set, forwarded into a container
    reuse_note: Optional[str] = None  # how the script is submitted again, when not on its own

    def __post_init__(self) -> None:
        if self.time is not None:
            check_time(self.time)


# sbatch --time: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or no limit
TIME_FORMAT = re.compile(r"\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}|(?i:infinite|unlimited)")


def check_time(value: str) -> None:
    """A time limit sbatch accepts, checked here: a wrong one would be found only when the script is submitted."""
    if not TIME_FORMAT.fullmatch(value):
        raise ConfigError(f"--time '{value}' is not a SLURM time limit; give minutes (90), MM:SS, HH:MM:SS "
                          "(24:00:00), D-HH, D-HH:MM or D-HH:MM:SS (2-00:00:00)")


def render_script(job: TrainJob, opts: SlurmOptions, output_dir: Path, workdir: Path,
                  environ: Optional[dict[str, str]] = None, command_line: str = "") -> str:
    """The sbatch script. `output_dir`, `workdir`: absolute; logs go to OUTPUT_DIR/logs/%x-%j.out."""
    environ = dict(os.environ if environ is None else environ)
    names, values = split_env(opts.env, "pass it by name: export {name} in this shell and give --env {name}")
    for name in names:
        if name not in environ:
            raise ConfigError(f"--env {name}: not set in this shell; export it before submitting (the job inherits "
                              "it by name, its value is never written)")
    argv = torchrun_argv(job, opts.max_restarts)
    log_name = "%x-%A_%a.out" if opts.replica_groups else "%x-%j.out"
    sbatch = [f"--job-name={opts.job_name}", f"--nodes={job.nodes}",
              *([f"--array=0-{opts.replica_groups - 1}     # one task per replica group"]
                if opts.replica_groups else []),
              "--ntasks-per-node=1          # one torchrun per node; it starts the node's ranks",
              f"--output={output_dir}/logs/{log_name}", "--open-mode=append           # a requeued job adds to its log",
              f"--chdir={workdir}", "--requeue", f'--signal=B:USR1@{opts.signal_seconds}    # see "Preemption" below',
              "--exclusive"]
    if opts.gpus_per_node:
        sbatch.append(f"--gpus-per-node={opts.gpus_per_node}")
    for flag, value in (("partition", opts.partition), ("time", opts.time), ("account", opts.account),
                        ("qos", opts.qos)):
        if value:
            sbatch.append(f"--{flag}={value}")
    sbatch += opts.extra_sbatch
    srun = ["srun", "--kill-on-bad-exit=1", "--ntasks-per-node=1"]
    if opts.container:
        forwarded = sorted(set(names) | {n for n in environ if n in FORWARD_NAMES or n.startswith(FORWARD_PREFIXES)}
                           | set(values) | {RDZV_ENDPOINT_ENV, RUN_ID_ENV, "OMP_NUM_THREADS"}
                           | set(opts.group_env))
        mounts = [f"{workdir}:{workdir}",
                  *([] if output_dir.is_relative_to(workdir) else [f"{output_dir}:{output_dir}"]), *opts.mounts]
        srun += [f"--container-image={opts.container}", f"--container-mounts={','.join(mounts)}",
                 f"--container-workdir={workdir}", f"--container-env={','.join(forwarded)}"]
    lines = [
        "#!/bin/bash",
        f"# Written by `ember launch slurm` on {datetime.now().isoformat(timespec='seconds')}"
        + (f":\n#   {command_line}" if command_line else "."),
        opts.reuse_note or "# Reusable as is: `sbatch THIS_FILE` submits the same job again (it resumes from the "
        "newest checkpoint).",
        *[f"#SBATCH {option}" for option in sbatch],
        "",
        "set -uo pipefail",
        'echo "ember: job $SLURM_JOB_ID started (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST '
        'at $(date -Is)"',
        "",
        "# Environment: the submitting shell's (sbatch's default --export=ALL), so NCCL_*, HF_HOME and HF_TOKEN",
        "# reach every rank by name; no value of a secret is ever written here.",
        *[f': "${{{name}:?{name} must be set in the shell that runs sbatch}}"' for name in names],
        *[f"export {name}={shlex.quote(value)}" for name, value in values.items()],
        "",
        "# Rendezvous: torchrun's c10d store on the first node, on a port derived from the job id, with the job id",
        "# as the rendezvous id. Node names need not resolve, so the address is the node's NodeAddr.",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'head_addr=$(scontrol show node "$head_node" | sed -n \'s/.*NodeAddr=\\([^ ]*\\).*/\\1/p\')',
        f'export {RDZV_ENDPOINT_ENV}="${{head_addr:-$head_node}}:$((20000 + SLURM_JOB_ID % 20000))"',
        f'export {RUN_ID_ENV}="$SLURM_JOB_ID"',
        "",
        *opts.group_lines,
        f"# Preemption and the time limit: SLURM sends USR1 to this shell {opts.signal_seconds} s before the end",
        "# (--signal=B:USR1@...; an admin can do the same with `scancel --batch --signal=USR1 JOB`). It is passed to",
        "# the training processes, which save a checkpoint at the next step boundary and exit; the job then",
        "# requeues itself (--requeue) and the next start resumes from that checkpoint (resume=auto).",
        "preempted=0",
        'on_usr1() { preempted=1; echo "ember: USR1: saving at the next step, then requeueing"; '
        'scancel --signal=USR1 "$SLURM_JOB_ID"; }',
        "trap on_usr1 USR1",
        "",
        "# One launcher per node. torchrun has no handler for USR1 and would die of it, so it ignores the signal",
        "# (an ignored signal stays ignored through exec) and leaves it to the ranks, which install their own.",
        "# --kill-on-bad-exit: a node whose ranks failed ends the job at once instead of leaving the others waiting.",
        shell_words(srun) + " \\",
        "  bash -c 'trap \"\" USR1; exec \"$@\"' _ \\",
        "  " + shell_words(argv[:argv.index("-m")]) + " \\",
        "    " + shell_words(argv[argv.index("-m"):]) + " &",
        "srun_pid=$!",
        "# `wait` returns early when the trap runs; wait again until srun itself has ended.",
        'while true; do wait "$srun_pid"; status=$?; '
        '{ [ "$status" -gt 128 ] && kill -0 "$srun_pid" 2>/dev/null; } || break; done',
        "",
        'if [ "$preempted" = 1 ]; then',
        '  echo "ember: requeueing job $SLURM_JOB_ID; it resumes from the checkpoint just saved"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "  exit 0",
        "fi",
        'if [ "$status" -ne 0 ]; then',
        '  echo "ember: job $SLURM_JOB_ID failed (exit code $status)"',
    ]
    if not opts.container:  # ember is installed here, not only in the image: name the rank that failed first
        lines.append('  python -m ember.launch.failures "$(scontrol show job "$SLURM_JOB_ID" | '
                     'sed -n \'s/^ *StdOut=//p\')" 2>/dev/null || true')
    lines += ["fi", 'exit "$status"', ""]
    script = "\n".join(lines)
    _refuse_secrets(script, environ)
    return script


def _refuse_secrets(text: str, environ: dict[str, str]) -> None:
    """A last guard: the script must not contain the value of any secret-looking variable of this shell."""
    for name, value in environ.items():
        if SECRET_NAME.search(name) and len(value) >= 8 and value in text:
            raise ConfigError(f"the script would contain the value of ${name}; pass secrets by name (--env {name})")


def write_script(script: str, output_dir: Path, job_name: str) -> Path:
    """OUTPUT_DIR/launch/JOB_NAME.sbatch, and the log directory sbatch needs to exist."""
    (output_dir / "logs").mkdir(parents=True, exist_ok=True)
    path = output_dir / "launch" / f"{job_name}.sbatch"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script)
    path.chmod(0o755)
    return path


def _slurm(*argv: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(list(argv), capture_output=True, text=True)
    except FileNotFoundError:
        raise EmberError(f"`{argv[0]}` not found: run this on a SLURM login node (or use --dry-run)") from None


# sbatch's refusals (words of its message, lowercase) -> the likely fix, said after its own message.
SBATCH_FIXES = (
    ("generic resource", "this partition has no GPUs to give (gres): start processes without a GPU request "
     "(--nproc-per-node instead of --gpus-per-node, or device=cpu) or choose a GPU --partition"),
    ("invalid partition", "--partition names no partition of this cluster (`sinfo -s` lists them)"),
    ("time limit", "--time exceeds the partition's limit (`sinfo -o '%P %l'` shows it)"),
    ("account", "--account (or --qos) is not one this user may submit to (`sacctmgr show assoc user=$USER`)"),
    ("qos", "--qos is not one this user may submit to (`sacctmgr show assoc user=$USER`)"),
    ("node configuration is not available", "no node offers what the script asks for (--nodes, --gpus-per-node, "
     "--sbatch options; `sinfo -N -l` lists the nodes)"),
    ("node count", "--nodes asks for more nodes than the partition has (`sinfo -s`)"),
)


def sbatch_error(script: Path, output: str) -> str:
    """sbatch's refusal as one line: its own last message, and the likely fix."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    message = lines[-1] if lines else "no message"
    for prefix in ("sbatch: error: ", "Batch job submission failed: "):
        message = message[len(prefix):] if message.startswith(prefix) else message
    fix = next((fix for words, fix in SBATCH_FIXES if words in message.lower()),
               "fix the #SBATCH options it names (ember launch slurm's flags, or --sbatch)")
    return f"sbatch refused {script}: {message.rstrip('.')}; {fix}"


def submit(script: Path, *options: str) -> str:
    """sbatch the script (with `options` before it: --dependency=...); the job id."""
    proc = _slurm("sbatch", "--parsable", *options, str(script))
    if proc.returncode != 0:
        raise EmberError(sbatch_error(script, proc.stderr or proc.stdout))
    return proc.stdout.strip().split(";")[0]


def job_info(job_id: str, strict: bool = False) -> dict[str, str]:
    """`scontrol show job -o` as a dict ({} once SLURM has forgotten the job). strict: scontrol failing for
    another reason (no controller reachable) is a one-line error instead of {}."""
    proc = _slurm("scontrol", "show", "job", "-o", job_id)
    if proc.returncode != 0:
        lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
        if strict and not any("invalid job id" in line.lower() for line in lines):
            raise EmberError(f"scontrol cannot tell about job {job_id}: {lines[-1] if lines else 'no message'} "
                             "(run this where SLURM's commands reach the cluster: a login node, SLURM_CONF)")
        return {}
    # Values hold no spaces except Command/WorkDir/StdOut paths with spaces, which this tolerates poorly;
    # the keys used here (JobState, ExitCode, StdOut, Restarts, NodeList) are plain.
    return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", proc.stdout))


def exit_status(info: dict[str, str]) -> int:
    """The job's exit code: ExitCode=code:signal; a signal counts as 128 + signal, like the shell."""
    code, _, sig = info.get("ExitCode", "1:0").partition(":")
    state = info.get("JobState", "")
    if state == "COMPLETED":
        return 0
    if int(sig or 0):
        return 128 + int(sig)
    return int(code) or 1


REQUEUE_GRACE_S = 300.0  # how long a job that requeued itself may look ended before `wait` believes it


def wait(job_id: str, out: Callable[[str], None] = lambda s: print(s, end="", flush=True),
         poll_s: float = 2.0) -> int:
    """Follow the job's log until it ends, through requeues; its exit status. The rank that failed first is
    named on failure."""
    offset, state, info = 0, "", {}
    log: Optional[Path] = None
    last_note = ""  # the latest `ember: ...` line of the script in the log
    final_since: Optional[float] = None
    while True:
        info = job_info(job_id) or info
        if info.get("StdOut"):
            log = Path(info["StdOut"])
        if log is not None and log.is_file():
            with log.open("rb") as f:
                f.seek(offset)
                chunk = f.read()
            offset += len(chunk)
            if chunk:
                text = chunk.decode(errors="replace")
                out(text)
                notes = [line for line in text.splitlines() if line.startswith("ember: ")]
                last_note = notes[-1] if notes else last_note
        state = info.get("JobState", "")
        if not info:
            break
        if state in FINAL_STATES:
            # A job that requeues itself passes through a final-looking state (FAILED while its batch shell is
            # ended) on its way back to PENDING, for as long as SLURM takes to requeue it. Its script said so
            # last ("ember: requeueing ..."): keep following, up to REQUEUE_GRACE_S in that state. Otherwise
            # final only if it still is a moment later.
            final_since = final_since or time.monotonic()
            if last_note.startswith("ember: requeueing") and time.monotonic() - final_since < REQUEUE_GRACE_S:
                time.sleep(poll_s)
                continue
            time.sleep(max(poll_s, 3.0))
            again = job_info(job_id)
            if not again or again.get("JobState") == state:
                break
            continue
        final_since = None
        time.sleep(poll_s)
    status = exit_status(info) if info else 1
    if status:
        from ember.launch.failures import first_failure

        culprit = first_failure(log.read_text(errors="replace")) if log and log.is_file() else None
        print(f"error: job {job_id} {state or 'ended'} (exit code {status})"
              + (f"; {culprit}" if culprit else ""), file=sys.stderr)
    else:
        print(f"job {job_id} {state}")
    return status


def unknown_job(job_id: str) -> EmberError:
    return EmberError(f"job {job_id} is not known to SLURM (finished more than MinJobAge ago, or on another "
                      f"cluster): `sacct -j {job_id}` has its record; "
                      f"its log is OUTPUT_DIR/logs/<job name>-{job_id}.out")


def array_tasks(job_id: str) -> list[dict[str, str]]:
    """The tasks of a job array (`scontrol show job -o ID` says one line each); [] for a job that is not one."""
    proc = _slurm("scontrol", "show", "job", "-o", job_id)
    lines = [line for line in proc.stdout.splitlines() if "ArrayTaskId=" in line] if proc.returncode == 0 else []
    if "_" in job_id:  # one task already
        return []
    tasks = [dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", line)) for line in lines]
    return sorted(tasks, key=lambda task: int(re.match(r"\d*", task.get("ArrayTaskId", "")).group() or 0))


def status(job_id: str) -> str:
    info = job_info(job_id, strict=True)
    if not info:
        raise unknown_job(job_id)
    tasks = array_tasks(job_id)
    if len(tasks) > 1:  # a job array (replica groups): every task, not the last one scontrol printed
        return "\n".join(f"job {job_id}_{task.get('ArrayTaskId')} {task.get('JobName', '')}: {task.get('JobState')} "
                         f"on {task.get('NodeList') or '-'}, restarts {task.get('Restarts', '0')}, exit code "
                         f"{task.get('ExitCode')}, log {task.get('StdOut')}" for task in tasks)
    return (f"job {job_id} {info.get('JobName', '')}: {info.get('JobState')} on {info.get('NodeList') or '-'}, "
            f"restarts {info.get('Restarts', '0')}, exit code {info.get('ExitCode')}, log {info.get('StdOut')}")


def cancel(job_id: str) -> None:
    if not job_info(job_id, strict=True):
        raise unknown_job(job_id)
    proc = _slurm("scancel", job_id)
    if proc.returncode != 0:
        lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
        raise EmberError(f"scancel {job_id} failed: {lines[-1] if lines else f'exit code {proc.returncode}'}")


def log_path(job_id: str) -> Path:
    info = job_info(job_id, strict=True)
    if not info.get("StdOut"):
        raise unknown_job(job_id)
    tasks = array_tasks(job_id)
    if len(tasks) > 1:
        ids = ", ".join(f"{job_id}_{task.get('ArrayTaskId')}" for task in tasks)
        raise EmberError(f"job {job_id} is an array of {len(tasks)} tasks (replica groups), each with its own log: "
                         f"give one of {ids}")
    return Path(info["StdOut"])
