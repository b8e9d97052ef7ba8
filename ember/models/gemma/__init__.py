"""The Gemma 3 family (text): 1B, 4B, 12B, 27B."""

from ember.models.gemma import hf
from ember.models.gemma.args import FLAVORS, GemmaArgs
from ember.models.gemma.model import Transformer, flops_per_token, num_params
from ember.models.gemma.parallelize import tp_plan

__all__ = ["FLAVORS", "GemmaArgs", "Transformer", "flops_per_token", "hf", "num_params", "tp_plan"]
