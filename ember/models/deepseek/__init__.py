"""The DeepSeek families: DeepSeek-V3 (`deepseek_v3`) and DeepSeek-V2 (`deepseek_v2`, V2-Lite's)."""

from ember.models.deepseek import hf
from ember.models.deepseek.args import FLAVORS, DeepseekArgs
from ember.models.deepseek.model import Transformer, flops_per_token, num_params
from ember.models.deepseek.parallelize import tp_plan

__all__ = ["FLAVORS", "DeepseekArgs", "Transformer", "flops_per_token", "hf", "num_params", "tp_plan"]
