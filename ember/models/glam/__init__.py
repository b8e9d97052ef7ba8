"""The GLaM family: MoE every other layer, top-2 of configurable experts (126M-64E, 64B-64E, debug)."""

from ember.models.glam import hf
from ember.models.glam.args import FLAVORS, GlamArgs
from ember.models.glam.model import Transformer, flops_per_token, num_params
from ember.models.llama.parallelize import tp_plan  # the dense parts are named as Llama's

__all__ = ["FLAVORS", "GlamArgs", "Transformer", "flops_per_token", "hf", "num_params", "tp_plan"]
