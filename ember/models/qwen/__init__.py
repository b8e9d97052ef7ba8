"""The Qwen families: Qwen2/2.5 (`qwen2`), Qwen3 dense (`qwen3`) and Qwen3-MoE (`qwen3_moe`)."""

from ember.models.qwen import hf
from ember.models.qwen.args import FLAVORS, QwenArgs, check_family
from ember.models.qwen.model import Transformer, flops_per_token, num_params
from ember.models.qwen.parallelize import tp_plan

__all__ = ["FLAVORS", "QwenArgs", "Transformer", "check_family", "flops_per_token", "hf", "num_params", "tp_plan"]
