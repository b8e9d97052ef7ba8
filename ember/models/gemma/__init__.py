"""The Gemma families: Gemma 3 (text: 1B, 4B, 12B, 27B) and Gemma 2 (2B, 9B, 27B), one model class."""

from ember.models.gemma import hf
from ember.models.gemma.args import FLAVORS, GEMMA2_FLAVORS, GemmaArgs
from ember.models.gemma.model import Transformer, flops_per_token, num_params
from ember.models.gemma.parallelize import gemma2_tp_plan, tp_plan

__all__ = ["FLAVORS", "GEMMA2_FLAVORS", "GemmaArgs", "Transformer", "flops_per_token", "gemma2_tp_plan", "hf",
           "num_params", "tp_plan"]
