"""How the GLaM family is parallelised: exactly as Mixtral, whose parallelize is written for every MoE
family (ember/models/mixtral/parallelize.py): expert parallelism over `model.moe_layers()` (here every
moe_every-th layer) -> TP/SP (the dense layers' gated-GELU FFN split like Llama's, the MoE layers on
sequence shards) -> CP -> activation checkpointing -> compile per block -> FSDP2. The tied
embedding/output matrix goes to FSDP's root unit (ember/parallel/fsdp.py reads args.tie_embeddings).
"""

from ember.models.mixtral.parallelize import parallelize

__all__ = ["parallelize"]
