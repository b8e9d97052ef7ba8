"""The Phi-3 family: Phi-3-mini and -medium, and from config.json the 128K models (LongRoPE) and Phi-4-mini."""

from ember.models.llama.parallelize import tp_plan  # ember's names are Llama's (hf.py fuses Phi-3's)
from ember.models.phi3 import hf
from ember.models.phi3.args import FLAVORS, Phi3Args
from ember.models.phi3.model import Transformer, flops_per_token, num_params

__all__ = ["FLAVORS", "Phi3Args", "Transformer", "flops_per_token", "hf", "num_params", "tp_plan"]
