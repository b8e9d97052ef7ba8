"""The one per-node command of a multi-node job, shared by the SLURM and Kubernetes launchers, so that both
run exactly the same thing: `torchrun ... -m ember train RECIPE key=value ...`.

What differs per scheduler is only how two values reach each node, so the command names them as environment
variables that the scheduler's side sets: EMBER_RDZV_ENDPOINT (host:port of torchrun's c10d store on the first
node) and EMBER_RUN_ID (the rendezvous id: the job's id, the same after a requeue or a restart).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from ember.config_schema import JobConfig
from ember.errors import ConfigError

RDZV_ENDPOINT_ENV = "EMBER_RDZV_ENDPOINT"
RUN_ID_ENV = "EMBER_RUN_ID"
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|CREDENTIAL", re.IGNORECASE)
ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")  # how the command names a variable: ${NAME}


@dataclass
class TrainJob:
    """A training job on `nodes` machines with `nproc_per_node` processes each."""

    recipe: str
    overrides: list[str] = field(default_factory=list)
    nodes: int = 1
    nproc_per_node: int = 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node


def check_job(job: TrainJob) -> tuple[TrainJob, JobConfig]:
    """Validate the job's config for its world size now, on the submitting machine, so that a typo fails in a
    second instead of after the queue. Returns the job with the dcn_mesh inferred (see `infer_dcn_mesh`) and
    the loaded JobConfig."""

    from ember.train import run as run_lib
    for name, value in (("--nodes", job.nodes), ("--nproc-per-node", job.nproc_per_node)):
        if value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")
    for item in job.overrides:
        if "=" not in item:
            raise ConfigError(f"expected key=value after the recipe, got '{item}' (e.g. max_steps=50)")
    job = infer_dcn_mesh(job)
    return job, run_lib.load_config(job.recipe, job.overrides, world_size=job.world_size)


def gpu_request(job: TrainJob, device: str, gpus_flag: bool) -> tuple[int, str]:
    """The GPUs to request per node, and a line saying what the job asks the scheduler for. --gpus-per-node
    (`gpus_flag`) requests one GPU per process; --nproc-per-node only with device=cuda, so that a CPU job (the
    config's default device=auto included) never asks a CPU cluster for GPUs it does not have."""
    if gpus_flag and device == "cpu":
        raise ConfigError(f"--gpus-per-node {job.nproc_per_node} requests GPUs for a device=cpu job; give "
                          f"--nproc-per-node {job.nproc_per_node} for CPU processes, or drop device=cpu")
    gpus = job.nproc_per_node if gpus_flag or device == "cuda" else 0
    nodes = f"{job.nodes} node{'s' if job.nodes > 1 else ''}"
    procs = f"{job.nproc_per_node} process{'es' if job.nproc_per_node > 1 else ''} each"
    if gpus:
        return gpus, f"requesting {nodes} x {procs}, {gpus} GPU{'s' if gpus > 1 else ''} per node"
    return 0, (f"requesting {nodes} x {procs}, no GPU (device={device}; --gpus-per-node G requests G GPUs "
               "per node)")


def infer_dcn_mesh(job: TrainJob) -> TrainJob:
    """Across nodes, shard with FSDP (`dcn_mesh.fsdp=NODES`) unless the recipe or the overrides name a dcn_mesh
    axis: the mesh is then node-major, so the ici_mesh axes (tensor, fsdp=-1, ...) stay inside a node and only
    FSDP's all-gathers and reduce-scatters cross the slower network. FSDP rather than replication because it
    fits any model size; `dcn_mesh.data=NODES` (HSDP) is one override away."""
    import yaml

    from ember import config as config_lib


    if job.nodes == 1 or any(item.startswith("dcn_mesh.") for item in job.overrides):
        return job
    recipe = yaml.safe_load(config_lib.resolve_recipe(job.recipe).read_text(encoding="utf-8"))
    if isinstance(recipe, dict) and "dcn_mesh" in recipe:
        return job
    return TrainJob(job.recipe, [*job.overrides, f"dcn_mesh.fsdp={job.nodes}"], job.nodes, job.nproc_per_node)


def split_env(env: list[str], secret_hint: str) -> tuple[list[str], dict[str, str]]:
    """--env items -> (NAMEs passed by name, NAME=VALUE settings to write). A secret-looking name is refused with
    a value: its value must never be written (`secret_hint` says how the scheduler passes it instead)."""
    names, values = [], {}
    for item in env:
        name, eq, value = item.partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ConfigError(f"--env '{item}': expected NAME or NAME=VALUE")
        if eq and SECRET_NAME.search(name):
            raise ConfigError(f"--env {name}=...: a secret is never written; {secret_hint.format(name=name)}")
        if eq:
            values[name] = value
        else:
            names.append(name)
    return names, values


def torchrun_argv(job: TrainJob, max_restarts: int = 0) -> list[str]:
    """Each node's command. c10d rendezvous: the nodes find each other through the store at the endpoint and
    torchrun numbers them itself (it ignores --node-rank with c10d), so the command is the same on every node.
    max_restarts=0: a failed rank ends the job (the scheduler's requeue or restart resumes it, resume=auto)."""
    return ["torchrun", "--nnodes", str(job.nodes), "--nproc-per-node", str(job.nproc_per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"${{{RDZV_ENDPOINT_ENV}}}", "--rdzv-id",
            f"${{{RUN_ID_ENV}}}", "--max-restarts", str(max_restarts),
            "-m", "ember", "train", job.recipe, *job.overrides]


def shell_words(argv: list[str]) -> str:
    """argv as one shell line: each word quoted, except that ${NAME} references stay expandable (in double
    quotes)."""
    words = []
    for arg in argv:
        if ENV_REF.search(arg):
            if re.search(r'["`\\]|\$(?!\{)', arg):
                raise ConfigError(f"cannot write '{arg}' into a shell script: it mixes quotes with ${{...}}")
            words.append(f'"{arg}"')
        else:
            words.append(shlex.quote(arg))
    return " ".join(words)


def kubernetes_args(argv: list[str]) -> list[str]:
    """argv for a container's `command`: Kubernetes expands $(NAME) from the container's env, with no shell."""
    return [ENV_REF.sub(r"$(\1)", arg) for arg in argv]


def refuse_finished(cfg: JobConfig) -> None:
    """A run that already holds its last step would only book nodes to say so (resume=auto continues from it)."""
    from ember.checkpoint.run_dir import newest_step
    from ember.storage.location import as_path

    if cfg.resume != "auto":
        return
    try:
        step = newest_step(as_path(cfg.output_dir) / "checkpoints")
    except Exception:  # a store this machine cannot list: the job finds out for itself
        return
    if step is not None and step >= cfg.max_steps:
        raise ConfigError(f"{cfg.output_dir} already holds step {step} of max_steps={cfg.max_steps}: "
                          "nothing to train; raise max_steps to train on from it, or give another output_dir")
