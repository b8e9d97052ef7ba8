"""`ember launch`: the same training job on a laptop, a SLURM cluster or Kubernetes.

local.py starts N processes on this machine through torchrun (`ember train --nproc-per-node`, `launch local`)
and collects the ranks' user errors; command.py builds the one torchrun command the cluster launchers run on
each node (and checks the job's config for its world size before anything is queued); slurm.py writes, submits
and follows an sbatch script; k8s.py writes a Kubeflow PyTorchJob manifest; failures.py finds the rank that
failed first in a job's log. The `ember launch` command line is ember/commands/launch.py.
"""
