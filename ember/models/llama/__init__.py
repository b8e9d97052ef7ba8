"""The Llama family: Llama 2, 3, 3.1, 3.2."""

from ember.models.llama import hf
from ember.models.llama.args import FLAVORS, LlamaArgs
from ember.models.llama.model import Transformer, flops_per_token, num_params
from ember.models.llama.parallelize import tp_plan

__all__ = ["FLAVORS", "LlamaArgs", "Transformer", "flops_per_token", "hf", "num_params", "tp_plan"]
