"""`ember launch`: the same training job on a laptop, a SLURM cluster, Kubernetes or Cloud TPUs.

local.py starts N processes on this machine through torchrun (`ember train --nproc-per-node`, `launch local`)
and collects the ranks' user errors; command.py builds the one torchrun command the cluster launchers run on
each node (and checks the job's config for its world size before anything is queued); slurm.py writes, submits
and follows an sbatch script; k8s.py writes a Kubeflow PyTorchJob manifest; tpu.py runs one
`ember train RECIPE device=tpu ...` per TPU host through `xpk workload create` or `gcloud compute tpus tpu-vm
ssh --worker=all` (no torchrun: the XLA path finds the other hosts itself); failures.py finds the rank that
failed first in a job's log. The `ember launch` command line is ember/commands/launch.py.
"""
