"""The Llama 4 family (text): Scout (17B active, 16 experts) and Maverick (17B active, 128 experts)."""

from ember.models.llama4 import hf
from ember.models.llama4.args import FLAVORS, Llama4Args
from ember.models.llama4.model import Transformer, flops_per_token, num_params
from ember.models.llama4.parallelize import tp_plan

__all__ = ["FLAVORS", "Llama4Args", "Transformer", "flops_per_token", "hf", "num_params", "tp_plan"]
