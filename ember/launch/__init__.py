"""`ember launch`: the same training job on a laptop, a SLURM cluster or Kubernetes.

command.py builds the one torchrun command every launcher runs on each node (and checks the job's config for
its world size before anything is queued); slurm.py writes, submits and follows an sbatch script; k8s.py writes
a Kubeflow PyTorchJob manifest; failures.py finds the rank that failed first in a job's log; cli.py is the
`ember launch` command.
"""
