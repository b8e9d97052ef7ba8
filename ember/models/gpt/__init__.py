"""The GPT family: a GPT-3-style decoder (learned positions, LayerNorm, GELU MLP, biases), Pax's sizes."""

from ember.models.gpt import hf
from ember.models.gpt.args import FLAVORS, GPTArgs
from ember.models.gpt.model import Transformer, flops_per_token, num_params
from ember.models.gpt.parallelize import tp_plan

__all__ = ["FLAVORS", "GPTArgs", "Transformer", "flops_per_token", "hf", "num_params", "tp_plan"]
