"""How the GLaM family is parallelised: exactly as Mixtral, whose parallelize is written for every MoE
family (ember/models/mixtral/parallelize.py): expert parallelism over `model.moe_layers()` (here every
moe_every-th layer) -> activation checkpointing -> compile per block -> FSDP2. The tied embedding/output
matrix goes to FSDP's root unit (ember/parallel/fsdp.py reads args.tie_embeddings). Tensor and context
parallelism are refused for MoE families by the config, as for Mixtral.
"""

from ember.models.mixtral.parallelize import parallelize

__all__ = ["parallelize"]
