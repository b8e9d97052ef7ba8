"""The Mistral family: Mistral 7B (v0.1 with its 4096-token sliding window, v0.3) and Mistral NeMo 12B."""

from ember.models.llama.parallelize import tp_plan  # the weights are named as Llama's
from ember.models.mistral import hf
from ember.models.mistral.args import FLAVORS, MistralArgs
from ember.models.mistral.model import Transformer, flops_per_token, num_params

__all__ = ["FLAVORS", "MistralArgs", "Transformer", "flops_per_token", "hf", "num_params", "tp_plan"]
