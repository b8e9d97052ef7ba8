"""Llama 4's tensor-parallel plan: Llama's (ember/models/llama/parallelize.py), whose names its attention and dense
layers share. Its q/k norms have no weight, so they need no entry; the MoE layers (routed and shared experts) run on
each tensor rank's sequence shard, as ember/parallel/parallelize.py places every MoE layer."""

from ember.models.llama.parallelize import tp_plan

__all__ = ["tp_plan"]
