"""`ember launch xpk` and `ember launch tpu-vm`: one `ember train RECIPE device=tpu key=value ...` on every TPU host,
started by XPK (`xpk workload create`: a JobSet on a GKE cluster with TPU node pools) or by `gcloud compute tpus
tpu-vm ssh --worker=all` (every worker of a TPU VM). Each host runs one process and ember's XLA path joins them
itself (jax.distributed.initialize()), so there is no torchrun and no rendezvous endpoint to hand out here.

The submitting machine need not have jax, nor the TPU's devices, so the job is checked without them: the config at
the schema level (`ember.config.load`: unknown keys, types, the checks that need only the config) and the mesh
against the TPU type's chips (`tpu_chips`), not through ember.train.run.load_config, whose checks need the run's own
device and world.
"""

from __future__ import annotations

import math
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from datetime import datetime
from typing import Optional

from ember import config as config_lib
from ember.config_schema import JobConfig
from ember.errors import ConfigError, EmberError
from ember.launch.local import STOP_EXIT_ENV
from ember.parallel.mesh_shape import AXES, MeshError, MeshShape, resolve_mesh
from ember.train import engines

XPK_PRIORITIES = ("very-low", "low", "medium", "high", "very-high")  # xpk workload create --priority's choices
# XPK's own check of --workload (xpk/parser/validators.py, workload_name_type), made here so that a bad name is
# refused before the config is checked and before xpk starts talking to the cluster.
WORKLOAD_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
WORKLOAD_MAX = 40
TIMESTAMP = "%Y%m%d-%H%M%S"

# TensorCores per chip of each generation whose accelerator type counts TensorCores (v4-8, v5p-128). A v4 or v5p
# chip's two TensorCores run as one device ("megacore"), so jax sees one device per chip; v5e (v5litepod-N) and v6e
# chips have one TensorCore and their types count chips. Cloud TPU's "TPU versions" pages; XPK's
# system_characteristics.py (tensorcores_per_chip) names the same types.
STOP_EXIT_CODE = 75  # EX_TEMPFAIL: a run stopped and saved, to be resumed (as `ember launch k8s` sets it)
CORES_PER_CHIP = {"v4": 2, "v5p": 2, "v5litepod": 1, "v6e": 1}
# The slice sizes Cloud TPU offers for v5e and v6e (chips); larger jobs take several slices (--num-slices).
SLICE_CHIPS = {"v5litepod": (1, 4, 8, 16, 32, 64, 128, 256), "v6e": (1, 4, 8, 16, 32, 64, 128, 256)}
# Their topologies (chips as a 2D grid), one per size.
SLICE_TOPOLOGIES = ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")

INSTALL_HINTS = {
    "xpk": "pip install xpk (it runs gcloud and kubectl, which it needs on PATH too)",
    "gcloud": "install the Google Cloud CLI (https://cloud.google.com/sdk/docs/install)",
}


def tpu_chips(tpu_type: str) -> int:
    """The chips of one slice of TPU_TYPE, which are its jax devices: v6e-256 -> 256, v5litepod-16 -> 16, v5p-128
    -> 64 and v4-8 -> 4 (their suffix counts TensorCores, two per chip); a topology (v6e-4x4, v5p-2x2x1, as XPK
    also takes) counts chips: its product."""
    generation, _, size = tpu_type.partition("-")
    if generation not in CORES_PER_CHIP or not re.fullmatch(r"[1-9]\d*(x[1-9]\d*)*", size):
        raise ConfigError(f"--tpu-type '{tpu_type}' is not a TPU type ember knows; give "
                          f"{', '.join(f'{g}-N' for g in CORES_PER_CHIP)} (e.g. v6e-256, v5p-128; v5e is "
                          "v5litepod-N) or a topology such as v6e-4x4")
    if "x" in size:
        chips = math.prod(int(side) for side in size.split("x"))
    else:
        cores, per_chip = int(size), CORES_PER_CHIP[generation]
        if cores % per_chip:
            raise ConfigError(f"--tpu-type '{tpu_type}': a {generation} type counts TensorCores, {per_chip} per chip, "
                              f"so its number is even (e.g. {generation}-{cores + 1})")
        chips = cores // per_chip
    sizes = SLICE_CHIPS.get(generation)
    if sizes and "x" in size and size not in SLICE_TOPOLOGIES:
        raise ConfigError(f"--tpu-type '{tpu_type}': a {generation} slice's topology is one of "
                          f"{', '.join(SLICE_TOPOLOGIES)}; give one of those or the chips (e.g. {generation}-256)")
    if sizes and chips not in sizes:
        raise ConfigError(f"--tpu-type '{tpu_type}': a {generation} slice has {', '.join(map(str, sizes[:-1]))} or "
                          f"{sizes[-1]} chips; give one of those (more chips: several slices, --num-slices)")
    return chips


def check_workload(name: str) -> None:
    """XPK's rule for a workload name, said before anything runs."""
    if not WORKLOAD_NAME.fullmatch(name) or len(name) > WORKLOAD_MAX:
        raise ConfigError(f"--workload '{name}': XPK takes lowercase letters, digits and '-', starting with a letter "
                          f"and ending with a letter or digit, at most {WORKLOAD_MAX} characters ({len(name)} here); "
                          "choose another or leave --workload out (ember-RECIPE-DATE-TIME)")


def default_workload(base: str, now: Optional[datetime] = None) -> str:
    """BASE (a valid name, e.g. `ember-llama3-1-8b`) cut to fit, then the date and time: a new workload each
    launch, within XPK's 40 characters."""
    stamp = (now or datetime.now()).strftime(TIMESTAMP)
    room = WORKLOAD_MAX - len(stamp) - 1
    cut = base[:room]
    if len(base) > room and base[room] != "-" and cut.count("-") > 1:  # not mid-word: v5e-256 would read v5e-25
        cut = cut.rsplit("-", 1)[0]
    return f"{cut.rstrip('-')}-{stamp}"


def host_command(recipe: str, overrides: list[str]) -> list[str]:
    """What each TPU host runs."""
    return ["ember", "train", recipe, "device=tpu", *overrides]


def hosts_overrides(recipe: str, overrides: list[str], launcher: str, num_slices: int = 1,
                    chips: Optional[int] = None) -> list[str]:
    """The overrides the hosts run after `device=tpu`, once the job is checked: the config's keys and types, and
    its mesh for `chips` x `num_slices` devices (with chips None, only that dcn_mesh spans the slices). Across
    slices the data is replicated, `dcn_mesh.data=N`, unless the recipe or the overrides name a dcn_mesh axis:
    slices meet over the data-center network, where MaxText's default is data parallelism too."""
    for item in overrides:
        key, _, value = item.partition("=")
        if key == "device" and value != "tpu":
            raise ConfigError(f"{item}: `ember launch {launcher}` runs device=tpu on every TPU host; drop {item}")
    overrides = [item for item in overrides if item.partition("=")[0] != "device"]
    cfg = _schema_checked(recipe, overrides)
    if (num_slices > 1 and not any(item.startswith("dcn_mesh.") for item in overrides)
            and all(getattr(cfg.dcn_mesh, axis) == 1 for axis in AXES)):
        overrides = [*overrides, f"dcn_mesh.data={num_slices}"]
        cfg = _schema_checked(recipe, overrides)
    _check_mesh(cfg, launcher, num_slices, chips)
    return overrides


def _schema_checked(recipe: str, overrides: list[str]) -> JobConfig:
    # output_dir and a resume path name the hosts' paths (a bucket's mount, a host's disk), not this machine's, and
    # config.load would look for them here: the check stands in a directory of this machine and resume=auto.
    return config_lib.load(recipe, [*overrides, "device=tpu", f"output_dir={tempfile.gettempdir()}", "resume=auto"])


def _check_mesh(cfg: JobConfig, launcher: str, num_slices: int, chips: Optional[int]) -> None:
    refuse = engines.rules(cfg.device).refuse  # the TPU engine's refusals (its rules import no jax)
    refuse(cfg, None)  # before the degrees are multiplied: a pipeline degree changes them
    dcn = {axis: getattr(cfg.dcn_mesh, axis) for axis in AXES}
    if -1 not in dcn.values() and math.prod(dcn.values()) != num_slices:
        raise _slices_error(dcn, launcher, num_slices)
    if chips is None:  # the degrees as given (an axis of -1 counted as 1): what the TPU path refuses, said here
        given = MeshShape(ici={a: max(getattr(cfg.ici_mesh, a), 1) for a in AXES},
                          dcn={a: max(v, 1) for a, v in dcn.items()})
        refuse(cfg, given)
        _check_model(cfg, given)
        return
    world = chips * num_slices
    try:
        shape = resolve_mesh(cfg.ici_mesh, cfg.dcn_mesh, world)
    except MeshError as err:
        raise ConfigError(f"{err} (here the devices are the TPU's chips: {chips} x {num_slices} slice"
                          f"{'s' if num_slices > 1 else ''} = {world})") from None
    if math.prod(shape.dcn.values()) != num_slices:  # a dcn_mesh axis of -1 took more than the slices
        raise _slices_error(shape.dcn, launcher, num_slices)
    refuse(cfg, shape)  # what `ember train device=tpu` refuses on the hosts, refused before submitting
    from ember.train.run import check_batch

    check_batch(cfg, shape)  # the batch against the mesh the slices make (the data is the hosts' to check)
    _check_model(cfg, shape)


def _check_model(cfg: JobConfig, shape: MeshShape) -> None:
    """model.* (remat, head_dim, ...) against the model and the layout, as the hosts would; a model.init_from is a
    path on the hosts, read there."""
    if not cfg.model.init_from:
        from ember.train.run import check_model

        check_model(cfg, shape)


def _slices_error(dcn: dict[str, int], launcher: str, num_slices: int) -> ConfigError:
    degrees = " x ".join(f"dcn_mesh.{axis}={value}" for axis, value in dcn.items() if value != 1) or "all 1"
    if launcher == "tpu-vm":
        return ConfigError(f"the dcn_mesh degrees ({degrees}) span slices, but a TPU VM is one slice; leave every "
                           "dcn_mesh degree 1 (ember launch xpk --num-slices N runs N slices)")
    product = math.prod(dcn.values())
    ones = " ".join(f"dcn_mesh.{axis}=1" for axis, value in dcn.items() if value != 1)
    other = (f"one, with {ones}" if num_slices == 1 else
             f"{num_slices}, with degrees that multiply to {num_slices} (e.g. dcn_mesh.data={num_slices})")
    return ConfigError(f"the dcn_mesh degrees ({degrees}) multiply to {product}, but --num-slices is {num_slices}; "
                       f"run {product} slices (--num-slices {product}) or {other}")


@dataclass(frozen=True)
class XpkJob:
    """`xpk workload create`'s flags (see `ember launch xpk --help`)."""

    cluster: str
    tpu_type: str
    docker_image: str
    workload: str
    num_slices: int = 1
    project: Optional[str] = None
    zone: Optional[str] = None
    priority: Optional[str] = None  # one of XPK_PRIORITIES; None: XPK's default (medium)
    max_restarts: int = 0  # JobSet restarts after a failure or a preemption (each resumes: resume=auto)


def xpk_argv(job: XpkJob, recipe: str, overrides: list[str]) -> list[str]:
    """The `xpk workload create` command, once the flags and then the job's config are checked."""
    check_workload(job.workload)
    if job.num_slices < 1:
        raise ConfigError(f"--num-slices must be >= 1, got {job.num_slices}")
    if job.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {job.max_restarts}")
    if job.priority is not None and job.priority not in XPK_PRIORITIES:
        raise ConfigError(f"--priority '{job.priority}' is not one of {', '.join(XPK_PRIORITIES)}")
    chips = tpu_chips(job.tpu_type)
    hosts = hosts_overrides(recipe, overrides, "xpk", job.num_slices, chips)
    # XPK puts --command into each container's `bash -c`: one shell line, each word quoted.
    argv = ["xpk", "workload", "create", "--cluster", job.cluster, "--workload", job.workload, "--tpu-type",
            job.tpu_type, "--num-slices", str(job.num_slices), "--docker-image", job.docker_image,
            "--command", shlex.join(host_command(recipe, hosts))]
    for flag, value in (("--project", job.project), ("--zone", job.zone), ("--priority", job.priority)):
        if value:
            argv += [flag, value]
    # A host stopped by SIGTERM (preempted, evicted) saves and exits 75, so the JobSet sees a failure, not a
    # finished run: with --max-restarts it restarts and every host resumes from that checkpoint.
    argv += ["--env", f"{STOP_EXIT_ENV}={STOP_EXIT_CODE}"]
    if job.max_restarts:
        argv += ["--max-restarts", str(job.max_restarts), "--restart-on-user-code-failure"]
    return argv


@dataclass(frozen=True)
class TpuVm:
    """A TPU VM (one slice, every worker a host) and where ember runs on it."""

    name: str
    zone: str
    project: Optional[str] = None
    workdir: Optional[str] = None  # on each worker; relative: under the ssh user's home
    tpu_type: Optional[str] = None  # only to check the mesh for its chips


def remote_dir(path: str) -> str:
    """PATH for the workers' shell: quoted, except a leading ~ or ~/, which the remote shell expands to the
    remote user's home (quoting it would keep the ~ literally)."""
    if path == "~":
        return path
    if path.startswith("~/"):
        return "~/" + shlex.quote(path[2:]) if path[2:] else "~/"
    return shlex.quote(path)


def tpu_vm_argv(vm: TpuVm, recipe: str, overrides: list[str]) -> list[str]:
    """The `gcloud compute tpus tpu-vm ssh` command that runs the same line on every worker, once the job is
    checked (its mesh only with vm.tpu_type: the TPU's type is not known here otherwise)."""
    chips = tpu_chips(vm.tpu_type) if vm.tpu_type else None
    command = shlex.join(host_command(recipe, hosts_overrides(recipe, overrides, "tpu-vm", 1, chips)))
    if vm.workdir:
        command = f"cd {remote_dir(vm.workdir)} && {command}"
    argv = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", vm.name, "--zone", vm.zone]
    if vm.project:
        argv += ["--project", vm.project]
    return [*argv, "--worker=all", "--command", command]


def print_or_run(argv: list[str], dry_run: bool) -> int:
    """--print / --dry-run: the command alone on stdout, exit 0; otherwise run it and return its exit code."""
    line = shlex.join(argv)
    if dry_run:
        print(line)
        print("not run (--print); run the line above, or leave --print out", file=sys.stderr)
        return 0
    if shutil.which(argv[0]) is None:
        raise EmberError(f"`{argv[0]}` is not on PATH: {INSTALL_HINTS[argv[0]]}, or give --print to see the command "
                         "without running it")
    print(f"running: {line}", file=sys.stderr, flush=True)
    return subprocess.run(argv).returncode
