"""`ember launch local|slurm|k8s|xpk|tpu-vm|status|cancel|logs`: one job description, several places to run it
(ember/launch; `launch local` is `ember train --nproc-per-node`, ember/commands/train.py; xpk and tpu-vm:
ember/launch/tpu.py)."""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

from ember.commands import train, wants_help
from ember.errors import EmberError
from ember.launch.local import LAUNCH_FLAGS, unknown_option
from ember.usage import ArgumentParser

DESCRIPTION = """Run a training job on this machine, a SLURM cluster, Kubernetes or TPUs. local, slurm and k8s
start the same `torchrun --nnodes N --nproc-per-node G --rdzv-backend c10d ... -m ember train RECIPE key=value ...`
on each node, with dcn_mesh.fsdp=N inferred from --nodes unless a dcn_mesh axis is given, and checks the config
for N x G processes before anything is submitted.

  ember launch local --nproc-per-node G [--nnodes M --node-rank R --rdzv-endpoint HOST:PORT] RECIPE [key=value ...]
  ember launch slurm RECIPE [key=value ...] --nodes N --gpus-per-node G [--partition P --time T ...] \
[--wait | --dry-run]
  ember launch k8s RECIPE [key=value ...] --nodes N --gpus-per-node G --image IMAGE [--namespace NS --pvc CLAIM] \
[--dry-run]
  ember launch xpk --cluster C --tpu-type v6e-256 [--num-slices N] --docker-image IMAGE RECIPE [key=value ...] [--print]
  ember launch tpu-vm --name TPU --zone Z [--workdir DIR] RECIPE [key=value ...] [--print]
  ember launch status|cancel|logs JOB          a SLURM job: its state, scancel, its log (and its first failing rank)

--gpus-per-node G starts G processes per node and requests G GPUs per node; --nproc-per-node G starts G
processes and requests no GPU unless the config says device=cuda. What is requested is printed.
xpk and tpu-vm run one `ember train RECIPE device=tpu key=value ...` per TPU host (docs/tpu-launch.md).
"""


def _job_args(parser: argparse.ArgumentParser, nodes_flag: str = "--nodes") -> None:
    parser.add_argument("recipe", help="a built-in recipe or a YAML path")
    parser.add_argument("overrides", nargs="*", default=[], metavar="key=value")  # a default: optional
    parser.add_argument(nodes_flag, dest="nodes", type=int, default=1, help="machines (default 1)")
    parser.add_argument("--gpus-per-node", type=int, default=None, metavar="G",
                        help="G processes per machine, one per GPU, and a request for G GPUs per machine")
    parser.add_argument("--nproc-per-node", type=int, default=None, metavar="G",
                        help="G processes per machine (default 1); GPUs are requested only with device=cuda")


def _job_id(text: str) -> str:
    """A SLURM job id (1234, an array task 1234_5, a heterogeneous job's component 1234+1), checked before
    scontrol is asked about it."""
    if not re.fullmatch(r"\d+([_+]\d+)?", text):
        raise argparse.ArgumentTypeError(f"'{text}' is not a SLURM job id (a number such as 1234; 1234_5 for an "
                                         "array task)")
    return text


def parser() -> tuple[ArgumentParser, dict[str, ArgumentParser]]:
    """The `ember launch` parser and its subcommands' parsers by name."""
    parser = ArgumentParser(prog="ember launch", description=DESCRIPTION,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="where", required=True, metavar="COMMAND")
    sub.add_parser("local", add_help=False, help="this machine: the built-in launcher of `ember train "
                   "--nproc-per-node` (see `ember launch local --help`)")
    slurm = sub.add_parser("slurm", help="write an sbatch script into OUTPUT_DIR/launch/ and submit it",
                           description="Write OUTPUT_DIR/launch/JOB_NAME.sbatch (readable; `sbatch` it again to "
                           "resubmit) and submit it. Logs: OUTPUT_DIR/logs/JOB_NAME-JOBID.out. The job saves and "
                           "requeues itself on SLURM's USR1 warning and resumes with resume=auto.")
    _job_args(slurm)
    slurm.add_argument("--partition")
    slurm.add_argument("--time", help="time limit, e.g. 24:00:00 (the job saves and requeues 120 s before it)")
    slurm.add_argument("--account")
    slurm.add_argument("--qos")
    slurm.add_argument("--job-name", help="default: ember-RECIPE")
    slurm.add_argument("--container", help="a pyxis/enroot image (srun --container-image) with ember installed")
    slurm.add_argument("--mounts", action="append", default=[], metavar="SRC:DST",
                       help="container mounts (repeatable; the working directory is always mounted)")
    slurm.add_argument("--env", action="append", default=[], metavar="NAME[=VALUE]",
                       help="NAME: must be set in this shell, forwarded by name (never written); NAME=VALUE: "
                       "written into the script (secrets refused). Repeatable")
    slurm.add_argument("--signal-seconds", type=int, default=120,
                       help="the USR1 warning before the time limit: time to save (default 120)")
    slurm.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                       help="another #SBATCH option, verbatim (repeatable), e.g. --sbatch=--mem=0")
    slurm.add_argument("--replica-groups", type=int, default=None, metavar="R",
                       help="a fault-tolerant job: R replica groups of --nodes nodes each (a job array, one task "
                       "per group) and torchft's lighthouse in a job of its own (fault_tolerance.*)")
    slurm.add_argument("--max-restarts", type=int, default=None, metavar="K",
                       help="with --replica-groups: torchrun restarts a group's failed ranks up to K times "
                       "(default 3); the group heals from a live peer")
    slurm.add_argument("--lighthouse-partition", metavar="P",
                       help="with --replica-groups: the lighthouse's partition (one CPU; default --partition)")
    slurm.add_argument("--wait", action="store_true", help="follow the log until the job ends (through requeues) "
                       "and exit with its status")
    slurm.add_argument("--dry-run", "--print", dest="dry_run", action="store_true",
                       help="write and print the script, submit nothing")
    k8s = sub.add_parser("k8s", help="write a Kubeflow PyTorchJob manifest (kubectl apply -f is yours)",
                         description="Write OUTPUT_DIR/launch/JOB_NAME.yaml: a Kubeflow PyTorchJob running the "
                         "same torchrun command on every pod, with the outputs on a shared volume claim.")
    _job_args(k8s)
    k8s.add_argument("--image", required=True, help="a container image with ember installed")
    k8s.add_argument("--namespace", default="default")
    k8s.add_argument("--job-name", help="default: ember-RECIPE (a DNS label)")
    k8s.add_argument("--pvc", help="an existing ReadWriteMany claim for outputs and checkpoints (default: the "
                     "manifest creates JOB_NAME-outputs)")
    k8s.add_argument("--storage", default="100Gi", help="size of the claim the manifest creates (default 100Gi)")
    k8s.add_argument("--storage-class", help="storage class of the claim the manifest creates")
    k8s.add_argument("--mount-path", default="/outputs", help="where the claim is mounted (default /outputs)")
    k8s.add_argument("--env", action="append", default=[], metavar="NAME[=VALUE]",
                     help="NAME=VALUE: set in the pods; NAME: from the Secret named by --secret (key NAME)")
    k8s.add_argument("--secret", help="a Secret holding the --env NAME values (e.g. HF_TOKEN)")
    k8s.add_argument("--backoff-limit", type=int, default=10, help="pod restarts before the job fails (default 10)")
    k8s.add_argument("--print", "--dry-run", dest="print_manifest", action="store_true",
                     help="also print the manifest (nothing is ever applied: `kubectl apply -f` is yours)")
    _tpu_parsers(sub)
    for name, help_ in (("status", "a SLURM job's state"), ("cancel", "scancel a SLURM job"),
                        ("logs", "a SLURM job's log and, if it failed, its first failing rank")):
        cmd = sub.add_parser(name, help=help_)
        cmd.add_argument("job_id", metavar="JOB", type=_job_id, help="a SLURM job id: 1234, or 1234_5 (an array task)")
        if name == "logs":
            cmd.add_argument("--follow", "-f", action="store_true", help="until the job ends")
    return parser, sub.choices


def _tpu_parsers(sub: argparse._SubParsersAction) -> None:
    """`launch xpk` and `launch tpu-vm`: their flags are XPK's and gcloud's, passed on (ember/launch/tpu.py)."""
    from ember.launch.tpu import XPK_PRIORITIES

    xpk = sub.add_parser("xpk", help="run on a GKE TPU cluster: `xpk workload create` (pip install xpk)",
                         description="Check the job for the TPU's chips, then run `xpk workload create` with "
                         "--command 'ember train RECIPE device=tpu key=value ...' (one process per TPU host).")
    vm = sub.add_parser("tpu-vm", help="run on every worker of a TPU VM: `gcloud compute tpus tpu-vm ssh --worker=all`",
                        description="Check the job, then run `ember train RECIPE device=tpu key=value ...` on every "
                        "worker of the TPU VM through `gcloud compute tpus tpu-vm ssh --worker=all`.")
    for cmd in (xpk, vm):
        cmd.add_argument("recipe", help="a built-in recipe, or a YAML path (read here for the check, and at the "
                         "same path on every TPU host)")
        cmd.add_argument("overrides", nargs="*", default=[], metavar="key=value")
        cmd.add_argument("--print", "--dry-run", dest="dry_run", action="store_true",
                         help="print the command, run nothing")
    xpk.add_argument("--cluster", required=True, help="the GKE cluster (made by `xpk cluster create`)")
    xpk.add_argument("--tpu-type", required=True, metavar="TYPE", help="one slice's type: v6e-256, v5p-128, "
                     "v5litepod-16, v4-8, or a topology such as v6e-4x4")
    xpk.add_argument("--num-slices", type=int, default=1, metavar="N", help="slices (default 1); dcn_mesh spans them")
    xpk.add_argument("--docker-image", required=True, metavar="IMAGE",
                     help="an image with ember, jax and torchax installed")
    xpk.add_argument("--workload", metavar="NAME", help="default: ember-RECIPE-DATE-TIME (at most 40 characters)")
    xpk.add_argument("--project", help="default: gcloud's configured project")
    xpk.add_argument("--zone", help="default: gcloud's configured zone")
    xpk.add_argument("--priority", choices=XPK_PRIORITIES, help="XPK's (default medium)")
    xpk.add_argument("--max-restarts", type=int, default=0, metavar="N",
                     help="restart the workload up to N times after a failure or a preemption, each time resuming "
                          "from the last checkpoint (default 0)")
    vm.add_argument("--name", required=True, metavar="TPU_NAME", help="the TPU VM")
    vm.add_argument("--zone", required=True)
    vm.add_argument("--project", help="default: gcloud's configured project")
    vm.add_argument("--workdir", metavar="DIR", help="where each worker runs ember (default: the ssh user's home)")
    vm.add_argument("--tpu-type", metavar="TYPE", help="the TPU's type (e.g. v6e-16): the mesh is checked for its "
                    "chips; without it, the config's keys and types only")


def parse(argv: list[str]) -> argparse.Namespace:
    """`where`: the subcommand; `launch local` takes `ember train`'s arguments (--nproc-per-node 1 unless a
    launcher flag is given)."""
    if argv and argv[0] == "local":
        rest = argv[1:]
        if wants_help(rest):  # train's usage under this name; what it equals stays `torchrun ... -m ember train`
            print(train.USAGE.replace("usage: ember train", "usage: ember launch local", 1))
            raise SystemExit(0)
        if not any(arg.split("=")[0] in LAUNCH_FLAGS for arg in rest):
            rest = ["--nproc-per-node", "1", *rest]
        args = train.parse(rest, "launch local")
    else:
        launch, commands = parser()
        if not argv:  # a usage error: on stderr, as argparse's own
            launch.print_help(sys.stderr)
            raise SystemExit(2)
        if argv[0] not in commands:  # --help, or argparse's one-line usage error
            launch.parse_args(argv)
        command = commands[argv[0]]
        # key=value overrides may come before or after the options, as with `ember train`; an unknown option is
        # named alone (argparse would lump the overrides after it in with it)
        _, extra = command.parse_known_intermixed_args(argv[1:])
        unknown = [arg.partition("=")[0] for arg in extra if arg.startswith("-") and arg != "-"]
        if unknown:
            options = [name for action in command._actions for name in action.option_strings
                       if name.startswith("--") and name != "--help"]
            raise unknown_option(unknown[0], f"launch {argv[0]}", options)
        args = command.parse_intermixed_args(argv[1:])
    args.where, args.command_line = argv[0], shlex.join(["ember", "launch", *argv])
    return args


def run(args: argparse.Namespace) -> int:
    if args.where == "local":
        return train.run(args)
    if args.where == "slurm":
        return _slurm(args)
    if args.where == "k8s":
        return _k8s(args)
    if args.where in ("xpk", "tpu-vm"):
        return _tpu(args)
    return _job_command(args)


def _prepare(args: argparse.Namespace) -> tuple[object, object, Path, int, str]:
    """The checked job, its config, its output directory, the GPUs to request per node and a line saying what
    is requested (printed once the script or manifest is written)."""
    from ember.launch.command import TrainJob, check_job, gpu_request

    if args.gpus_per_node is not None and args.nproc_per_node is not None:
        raise EmberError("give --gpus-per-node G (G processes and G GPUs per node) or --nproc-per-node G "
                         "(G processes), not both")
    nproc = args.gpus_per_node if args.gpus_per_node is not None else args.nproc_per_node or 1
    job, cfg = check_job(TrainJob(args.recipe, list(args.overrides), args.nodes, nproc))
    gpus, request = gpu_request(job, cfg.device, args.gpus_per_node is not None)
    return job, cfg, launch_dir(cfg.output_dir), gpus, request


def launch_dir(output_dir: str) -> Path:
    """Where the script or manifest and the job's logs go: the run's directory, or for a URL output_dir (which
    the job writes to itself) ./ember-launch/BUCKET-PATH in the working directory, which every node mounts."""
    from ember.storage.location import is_url

    if is_url(output_dir):
        name = re.sub(r"[^A-Za-z0-9._-]+", "-", output_dir.rstrip("/")).strip("-")
        return Path.cwd() / "ember-launch" / name
    return Path(output_dir).expanduser().resolve()


def _default_name(recipe: str) -> str:
    stem = Path(recipe).stem if recipe.endswith((".yaml", ".yml")) else recipe
    return "ember-" + (re.sub(r"[^a-z0-9-]+", "-", stem.lower()).strip("-") or "job")


def _slurm(args: argparse.Namespace) -> int:
    from ember.launch import slurm
    from ember.launch.command import refuse_finished

    # The flags' own formats first: a mistyped flag is said before what the job's config needs.
    if args.time is not None:
        slurm.check_time(args.time)
    if args.signal_seconds < 1:
        raise EmberError(f"--signal-seconds must be >= 1, got {args.signal_seconds}")
    groups = _replica_groups(args)
    job, cfg, output_dir, gpus, request = _prepare(args)
    if not args.dry_run:
        refuse_finished(cfg)
    if groups and not args.dry_run:  # before anything is written: every group must fit at once
        from ember.launch.slurm_groups import check_capacity

        check_capacity(args.partition, args.lighthouse_partition, groups, args.nodes)
    opts = slurm.SlurmOptions(job_name=args.job_name or _default_name(args.recipe), partition=args.partition,
                              time=args.time, account=args.account, qos=args.qos,
                              gpus_per_node=gpus, container=args.container, mounts=args.mounts, env=args.env,
                              signal_seconds=args.signal_seconds, extra_sbatch=args.sbatch, replica_groups=groups,
                              max_restarts=args.max_restarts or 0)
    if groups:
        from ember.launch import slurm_groups

        opts.group_lines = slurm_groups.group_lines(groups, slurm_groups.lighthouse_file(output_dir, opts.job_name))
        opts.group_env, opts.reuse_note = list(slurm_groups.GROUP_NAMES), slurm_groups.REUSE_NOTE.format(
            name=opts.job_name)
    script = slurm.render_script(job, opts, output_dir, Path.cwd(),
                                 command_line=args.command_line)
    path = slurm.write_script(script, output_dir, opts.job_name)
    print(request + (f", for each of {groups} replica groups" if groups else ""), file=sys.stderr)
    if groups:
        return _slurm_groups(args, cfg, opts, output_dir, path, script)
    if args.dry_run:
        _print_written(script, f"wrote {path} (not submitted: --dry-run)")
        return 0
    job_id = slurm.submit(path)
    print(f"submitted job {job_id}: {path}\nlog: {output_dir}/logs/{opts.job_name}-{job_id}.out", flush=True)
    return slurm.wait(job_id) if args.wait else 0


def _replica_groups(args: argparse.Namespace) -> int:
    """--replica-groups R: the fault-tolerance overrides added to the job (checked with it); 0 without."""
    from ember.launch.replica_groups import DEFAULT_MAX_RESTARTS, group_overrides

    if args.replica_groups is None:
        if args.max_restarts is not None or args.lighthouse_partition:
            raise EmberError("--max-restarts and --lighthouse-partition go with --replica-groups R")
        return 0
    if args.replica_groups < 1:
        raise EmberError(f"--replica-groups must be >= 1, got {args.replica_groups}")
    if args.max_restarts is not None and args.max_restarts < 0:
        raise EmberError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    args.max_restarts = DEFAULT_MAX_RESTARTS if args.max_restarts is None else args.max_restarts
    args.overrides = group_overrides(list(args.overrides), args.replica_groups)
    return args.replica_groups


def _slurm_groups(args: argparse.Namespace, cfg: object, opts: object, output_dir: Path, path: Path,
                  script: str) -> int:
    """The lighthouse's script beside the groups' one, both submitted (the groups after the lighthouse)."""
    from ember.launch import slurm, slurm_groups

    lighthouse = slurm_groups.render_lighthouse(
        opts.job_name, output_dir, Path.cwd(), cfg.fault_tolerance.min_replica_groups,
        args.lighthouse_partition or args.partition, args.account, args.qos, args.time, args.command_line)
    lighthouse_path = slurm.write_script(lighthouse, output_dir, f"{opts.job_name}-lighthouse")
    if args.dry_run:
        _print_written(script, f"wrote {path} and {lighthouse_path} (not submitted: --dry-run)")
        return 0
    from ember.train.fault_tolerance import group_dir

    try:
        lighthouse_id, groups_id = slurm_groups.submit_groups(lighthouse_path, path, output_dir, opts.job_name,
                                                              slurm.submit)
    except EmberError as err:  # sbatch's advice names --partition; the lighthouse's is --lighthouse-partition
        if args.lighthouse_partition and "lighthouse.sbatch" in str(err):
            raise EmberError(str(err).replace("--partition names", "--lighthouse-partition names")) from None
        raise
    logs = output_dir / "logs"
    print(f"submitted lighthouse job {lighthouse_id}: {lighthouse_path}, log "
          f"{logs}/{opts.job_name}-lighthouse-{lighthouse_id}.out, address in "
          f"{slurm_groups.lighthouse_file(output_dir, opts.job_name)} once it runs", flush=True)
    for group in range(args.replica_groups):
        print(f"replica group {group}: job {groups_id}_{group}, log {logs}/{opts.job_name}-{groups_id}_{group}.out, "
              f"run {group_dir(cfg.output_dir, group)}", flush=True)
    return slurm_groups.wait_groups(lighthouse_id, groups_id, args.replica_groups) if args.wait else 0


def _k8s(args: argparse.Namespace) -> int:
    from ember.launch import k8s

    job, cfg, output_dir, gpus, request = _prepare(args)
    opts = k8s.K8sOptions(name=args.job_name or _default_name(args.recipe), image=args.image,
                          namespace=args.namespace, pvc=args.pvc, storage=args.storage,
                          storage_class=args.storage_class, mount_path=args.mount_path, env=args.env,
                          secret=args.secret, backoff_limit=args.backoff_limit,
                          gpus_per_node=gpus)
    manifest = k8s.render_manifest(job, opts)
    path = output_dir / "launch" / f"{opts.name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(manifest)
    print(request, file=sys.stderr)
    if args.print_manifest:
        _print_written(manifest, f"wrote {path} (not applied: `kubectl apply -f {path}` starts it)")
    else:
        print(f"wrote {path}; start it with: kubectl apply -f {path}")
    return 0


def _tpu(args: argparse.Namespace) -> int:
    from ember.launch import tpu

    if args.where == "xpk":
        job = tpu.XpkJob(cluster=args.cluster, tpu_type=args.tpu_type, docker_image=args.docker_image,
                         workload=args.workload or tpu.default_workload(_default_name(args.recipe)),
                         num_slices=args.num_slices, project=args.project, zone=args.zone, priority=args.priority,
                         max_restarts=args.max_restarts)
        argv = tpu.xpk_argv(job, args.recipe, list(args.overrides))
    else:
        vm = tpu.TpuVm(name=args.name, zone=args.zone, project=args.project, workdir=args.workdir,
                       tpu_type=args.tpu_type)
        argv = tpu.tpu_vm_argv(vm, args.recipe, list(args.overrides))
    return tpu.print_or_run(argv, args.dry_run)


def _print_written(text: str, note: str) -> None:
    """--print / --dry-run of slurm and k8s alike: stdout holds the file's text alone (`> job.yaml` keeps it
    whole), and what was written is said on stderr."""
    print(text, end="" if text.endswith("\n") else "\n")
    print(note, file=sys.stderr)


def _job_command(args: argparse.Namespace) -> int:
    from ember.launch import slurm

    if args.where == "status":
        print(slurm.status(args.job_id))
        return 0
    if args.where == "cancel":
        slurm.cancel(args.job_id)
        print(f"cancelled job {args.job_id}")
        return 0
    if args.follow:
        slurm.log_path(args.job_id)  # an unknown job, or an array of groups (which asks for one task), said first
        return slurm.wait(args.job_id)
    log = slurm.log_path(args.job_id)
    text = log.read_text(errors="replace") if log.is_file() else ""
    print(text, end="")
    info = slurm.job_info(args.job_id)
    if info.get("JobState") in slurm.FINAL_STATES and slurm.exit_status(info):
        from ember.launch.failures import first_failure

        culprit = first_failure(text)
        print(f"error: job {args.job_id} {info['JobState']}" + (f"; {culprit}" if culprit else ""), file=sys.stderr)
    return 0

