"""`ember launch k8s`: a Kubeflow PyTorchJob manifest that runs the shared torchrun command (command.py) on every
pod, with checkpoints on a shared volume claim. Applying it (`kubectl apply -f`) is the user's step.

Why a PyTorchJob (Kubeflow training operator, kubeflow.org/v1) and not a JobSet: it is the resource most
clusters that run multi-node PyTorch already have; its operator makes the headless service of each replica
(`NAME-master-0` resolves to the first pod, which hosts torchrun's c10d store) and recreates pods that are
deleted or evicted; and its schema is published with an SDK on PyPI (kubeflow-training), which the tests
validate against. A JobSet would need the same command and a hand-made service name; nothing here depends on
the operator beyond the service name.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from ember.errors import ConfigError
from ember.launch.command import RDZV_ENDPOINT_ENV, RUN_ID_ENV, TrainJob, kubernetes_args, split_env, torchrun_argv

RDZV_PORT = 29500


@dataclass
class K8sOptions:
    name: str
    image: str
    namespace: str = "default"
    pvc: Optional[str] = None  # an existing claim; None: the manifest creates NAME-outputs
    storage: str = "100Gi"
    storage_class: Optional[str] = None
    mount_path: str = "/outputs"
    env: list[str] = field(default_factory=list)  # NAME=VALUE, or NAME (from the Secret `secret`, key NAME)
    secret: Optional[str] = None
    backoff_limit: int = 10
    gpus_per_node: int = 0


def _env(opts: K8sOptions) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        # The first pod's headless service (made by the operator) hosts the rendezvous; the job's name is the
        # rendezvous id, the same after a pod restart.
        {"name": RDZV_ENDPOINT_ENV, "value": f"{opts.name}-master-0:{RDZV_PORT}"},
        {"name": RUN_ID_ENV, "value": opts.name},
        # A pod stopped by SIGTERM (evicted, preempted) makes every rank save and stop; exiting 75 (EX_TEMPFAIL)
        # instead of 0 makes every pod fail, so OnFailure restarts them all and resume=auto goes on from there
        # (with 0, the others would finish as Succeeded and the restarted pod would wait for them forever).
        {"name": "EMBER_EXIT_CODE_ON_STOP", "value": "75"},
    ]
    names, values = split_env(opts.env, "put it in a Secret and give --env {name} --secret SECRET_NAME")
    env += [{"name": name, "value": value} for name, value in values.items()]
    if names and opts.secret is None:
        raise ConfigError(f"--env {names[0]}: give --secret SECRET_NAME, the Secret that holds {names[0]}")
    env += [{"name": name, "valueFrom": {"secretKeyRef": {"name": opts.secret, "key": name}}} for name in names]
    return env


def pod_template(job: TrainJob, opts: K8sOptions) -> dict[str, Any]:
    claim = opts.pvc or f"{opts.name}-outputs"
    resources: dict[str, Any] = {}
    if opts.gpus_per_node:
        resources = {"limits": {"nvidia.com/gpu": opts.gpus_per_node}}
    container = {
        "name": "pytorch",  # the operator looks for the container of this name
        "image": opts.image,
        "command": kubernetes_args(torchrun_argv(job)),
        "env": _env(opts),
        "ports": [{"name": "pytorchjob-port", "containerPort": RDZV_PORT}],
        "resources": resources,
        "volumeMounts": [{"name": "outputs", "mountPath": opts.mount_path},
                         {"name": "dshm", "mountPath": "/dev/shm"}],  # collectives and loaders need shared memory
    }
    return {"spec": {"containers": [container],
                     "volumes": [{"name": "outputs", "persistentVolumeClaim": {"claimName": claim}},
                                 {"name": "dshm", "emptyDir": {"medium": "Memory"}}]}}


def pod_job(job: TrainJob, opts: K8sOptions) -> TrainJob:
    """The job as the pods run it: outputs on the claim unless output_dir is given."""
    if any(item.startswith("output_dir=") for item in job.overrides):
        return job
    return TrainJob(job.recipe, [*job.overrides, f"output_dir={opts.mount_path}/{opts.name}"], job.nodes,
                    job.nproc_per_node)


def manifest_docs(job: TrainJob, opts: K8sOptions) -> list[dict[str, Any]]:
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,40}[a-z0-9])?", opts.name):
        raise ConfigError(f"--job-name '{opts.name}': a Kubernetes name is lowercase letters, digits and '-' "
                          "(at most 42 characters here: pod and service names add suffixes)")
    if opts.backoff_limit < 0:
        raise ConfigError(f"--backoff-limit must be >= 0, got {opts.backoff_limit}")
    job = pod_job(job, opts)
    template = pod_template(job, opts)
    # OnFailure: a pod whose torchrun failed (its rank died, or a peer did and the collective failed) restarts
    # in place; every node rejoins the rendezvous and the run resumes from its newest checkpoint (resume=auto).
    # backoffLimit bounds the restarts, so a mistake that fails every time ends the job.
    replicas = {"Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": template}}
    if job.nodes > 1:
        replicas["Worker"] = {"replicas": job.nodes - 1, "restartPolicy": "OnFailure",
                              "template": copy.deepcopy(template)}  # a copy: no YAML anchors in the file
    docs: list[dict[str, Any]] = []
    if opts.pvc is None:
        spec: dict[str, Any] = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": opts.storage}}}
        if opts.storage_class:
            spec["storageClassName"] = opts.storage_class
        docs.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                     "metadata": {"name": f"{opts.name}-outputs", "namespace": opts.namespace}, "spec": spec})
    docs.append({
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": opts.name, "namespace": opts.namespace},
        "spec": {"nprocPerNode": str(job.nproc_per_node),
                 "runPolicy": {"backoffLimit": opts.backoff_limit, "cleanPodPolicy": "None"},
                 "pytorchReplicaSpecs": replicas},
    })
    return docs


def render_manifest(job: TrainJob, opts: K8sOptions) -> str:
    header = (f"# Written by `ember launch k8s`: {job.nodes} pod(s) x {job.nproc_per_node} process(es), each running\n"
              "# the same torchrun command as `ember launch slurm`. Start it with `kubectl apply -f THIS_FILE`.\n")
    return header + yaml.safe_dump_all(manifest_docs(job, opts), sort_keys=False, width=120)
