"""`ember launch k8s`: the manifest is valid against the published schemas (Kubernetes' own for the claim and
the pod templates, via kubernetes-validate; the PyTorchJob's shipped under tests/launch/schemas, its field names
checked against the kubeflow-training SDK) and runs exactly the command the SLURM script runs."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from ember.launch.command import TrainJob, kubernetes_args, torchrun_argv
from ember.launch.k8s import K8sOptions, manifest_docs, render_manifest
from ember.launch.slurm import SlurmOptions, render_script
from tests.helpers import run_ember

HERE = Path(__file__).parent
K8S_VERSION = "1.31"
JOB = TrainJob("debug", ["model.n_layers=1", "micro_batch_size=1", "global_batch_size=16", "output_dir=/outputs/x",
                         "dcn_mesh.fsdp=2"], nodes=2, nproc_per_node=8)


def test_the_manifest_passes_the_published_schemas():
    opts = K8sOptions(name="ember-debug", image="ghcr.io/example/ember:1", env=["HF_TOKEN", "NCCL_DEBUG=INFO"],
                      secret="hf", gpus_per_node=8)
    claim, job = yaml.safe_load_all(render_manifest(JOB, opts))
    kubernetes_validate.validate(claim, K8S_VERSION, strict=True)
    schema = json.loads((HERE / "schemas" / "pytorchjob-v1.schema.json").read_text())
    jsonschema.validate(job, schema)
    for role, replica in job["spec"]["pytorchReplicaSpecs"].items():
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role.lower()},
                                      "template": replica["template"]}, K8S_VERSION, strict=True)
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    (container,) = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "HF_TOKEN"}}} in container["env"]
    # an evicted pod's SIGTERM stops (and saves) every rank; all must fail for OnFailure to restart them all
    assert {"name": "EMBER_EXIT_CODE_ON_STOP", "value": "75"} in container["env"]
    # The shipped schema's field names are the SDK's (kubeflow-training's generated models).
    from kubeflow.training import models

    sdk = {model: set(getattr(models, model).attribute_map.values())
           for model in ("KubeflowOrgV1PyTorchJobSpec", "KubeflowOrgV1ReplicaSpec", "KubeflowOrgV1RunPolicy")}
    assert set(schema["properties"]["spec"]["properties"]) <= sdk["KubeflowOrgV1PyTorchJobSpec"]
    assert set(schema["$defs"]["replicaSpec"]["properties"]) <= sdk["KubeflowOrgV1ReplicaSpec"]
    assert set(schema["properties"]["spec"]["properties"]["runPolicy"]["properties"]) <= sdk["KubeflowOrgV1RunPolicy"]


def test_kubernetes_and_slurm_run_the_same_torchrun_command(tmp_path: Path):
    docs = manifest_docs(JOB, K8sOptions(name="ember-debug", image="img", pvc="shared"))
    assert [d["kind"] for d in docs] == ["PyTorchJob"]  # an existing claim: none created
    pods = docs[0]["spec"]["pytorchReplicaSpecs"]
    k8s_commands = {role: spec["template"]["spec"]["containers"][0]["command"] for role, spec in pods.items()}
    script = render_script(JOB, SlurmOptions(job_name="ember-debug"), tmp_path, tmp_path, environ={})
    # The srun line: `srun ... bash -c '...' _ torchrun ... -m ember train ...` (continued over lines).
    srun_line = re.search(r"^srun .*?&$", script.replace("\\\n", " "), re.MULTILINE | re.DOTALL).group(0)
    words = shlex.split(srun_line.rstrip("&"))
    slurm_command = words[words.index("_") + 1:]
    assert slurm_command == torchrun_argv(JOB)
    for command in k8s_commands.values():
        # Kubernetes writes $(NAME) where the script writes ${NAME}: otherwise word for word the same.
        assert command == kubernetes_args(slurm_command)
        assert command[command.index("-m"):] == ["-m", "ember", "train", *(["debug"] + JOB.overrides)]


@pytest.mark.slow
def test_k8s_command_line(tmp_path: Path):
    out = tmp_path / "run"
    proc = run_ember("launch", "k8s", "debug", "model.n_layers=1", "micro_batch_size=4", f"output_dir={out}",
                     "--nodes", "2", "--nproc-per-node", "1", "--image", "img:1", "device=cpu")
    assert proc.returncode == 0, proc.stderr
    claim, job = yaml.safe_load_all((out / "launch" / "ember-debug.yaml").read_text())
    command = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"]
    assert "dcn_mesh.fsdp=2" in command  # inferred from --nodes
    assert "nvidia.com/gpu" not in json.dumps(job)  # device=cpu: no GPU request
    # A secret's value is refused; a name needs the Secret that holds it.
    proc = run_ember("launch", "k8s", "debug", "--image", "i", "--env", "HF_TOKEN=hf_abcdefgh12345")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "hf_abcdefgh12345" not in proc.stderr
    proc = run_ember("launch", "k8s", "debug", "--image", "i", "--env", "HF_TOKEN")
    assert proc.returncode == 2 and "--secret" in proc.stderr
    proc = run_ember("launch", "k8s", "debug", "--image", "i", "--job-name", "Bad_Name")
    assert proc.returncode == 2 and "Bad_Name" in proc.stderr and proc.stderr.count("\n") == 1
