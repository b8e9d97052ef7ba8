"""The Mixtral family: a top-2 mixture of 8 experts (8x7B, 8x22B, debug)."""

from ember.models.llama.parallelize import tp_plan  # the dense parts are named as Llama's
from ember.models.mixtral import hf
from ember.models.mixtral.args import FLAVORS, MixtralArgs
from ember.models.mixtral.model import Transformer, flops_per_token, num_params

__all__ = ["FLAVORS", "MixtralArgs", "Transformer", "flops_per_token", "hf", "num_params", "tp_plan"]
