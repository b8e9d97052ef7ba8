"""Model families: MODELS maps a `model.family` to what the trainer needs. A plain dict."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

from torch import nn

from ember.errors import ConfigError, did_you_mean
from ember.models import checks, deepseek, gemma, glam, gpt, llama, llama4, mistral, mixtral, phi3, qwen


@dataclass(frozen=True)
class ModelSpec:
    name: str  # the family, as `model.family` names it
    flavors: dict[str, Any]  # flavor name -> args dataclass
    model_cls: type  # model_cls(args) -> nn.Module; build it on the meta device
    args_cls: type
    # loss_parallel -> (model-level, per-block) tensor-parallel plans; ember/parallel/parallelize.py applies
    # it with every other parallelism
    tp_plan: Callable[[bool], tuple[dict[str, Any], dict[str, Any]]]
    flops_per_token: Callable[[Any, int], float]  # (args, seq_len) -> training FLOPs per token
    hf: ModuleType  # config and weight mapping to and from Hugging Face
    # (model) -> the parameters one token passes through (a mixture of experts uses top_k of its experts);
    # None: every parameter (a dense family). `ember recipes` shows it as "active".
    active_params: Callable[[nn.Module], int] | None = None


MODELS: dict[str, ModelSpec] = {
    family: ModelSpec(family, flavors, llama.Transformer, llama.LlamaArgs, llama.tp_plan,
                      llama.flops_per_token, llama.hf)
    for family, flavors in llama.FLAVORS.items()  # llama2, llama3, llama3.1, llama3.2
}
MODELS["mixtral"] = ModelSpec("mixtral", mixtral.FLAVORS, mixtral.Transformer, mixtral.MixtralArgs,
                              mixtral.tp_plan, mixtral.flops_per_token, mixtral.hf,
                              active_params=functools.partial(mixtral.num_params, active=True))
MODELS["gpt"] = ModelSpec("gpt", gpt.FLAVORS, gpt.Transformer, gpt.GPTArgs, gpt.tp_plan,
                          gpt.flops_per_token, gpt.hf)
MODELS["glam"] = ModelSpec("glam", glam.FLAVORS, glam.Transformer, glam.GlamArgs, glam.tp_plan,
                           glam.flops_per_token, glam.hf, active_params=functools.partial(glam.num_params, active=True))

MODELS["mistral"] = ModelSpec("mistral", mistral.FLAVORS, mistral.Transformer, mistral.MistralArgs, mistral.tp_plan,
                              mistral.flops_per_token, mistral.hf)
MODELS["phi3"] = ModelSpec("phi3", phi3.FLAVORS, phi3.Transformer, phi3.Phi3Args, phi3.tp_plan, phi3.flops_per_token,
                           phi3.hf)
MODELS["llama4"] = ModelSpec("llama4", llama4.FLAVORS, llama4.Transformer, llama4.Llama4Args, llama4.tp_plan,
                             llama4.flops_per_token, llama4.hf,
                             active_params=functools.partial(llama4.num_params, active=True))
MODELS["gemma3"] = ModelSpec("gemma3", gemma.FLAVORS, gemma.Transformer, gemma.GemmaArgs, gemma.tp_plan,
                             gemma.flops_per_token, gemma.hf)
MODELS["gemma2"] = ModelSpec("gemma2", gemma.GEMMA2_FLAVORS, gemma.Transformer, gemma.GemmaArgs, gemma.gemma2_tp_plan,
                             gemma.flops_per_token, gemma.hf)
for family, flavors in qwen.FLAVORS.items():  # qwen2 (Qwen2/2.5), qwen3, qwen3_moe
    MODELS[family] = ModelSpec(family, flavors, qwen.Transformer, qwen.QwenArgs,
                               llama.tp_plan if family == "qwen2" else qwen.tp_plan,  # Qwen2 has no q/k norms
                               qwen.flops_per_token, qwen.hf,
                               active_params=functools.partial(qwen.num_params, active=True))
for family, flavors in deepseek.FLAVORS.items():  # deepseek_v3, deepseek_v2 (V2-Lite)
    MODELS[family] = ModelSpec(family, flavors, deepseek.Transformer, deepseek.DeepseekArgs, deepseek.tp_plan,
                               deepseek.flops_per_token, deepseek.hf,
                               active_params=functools.partial(deepseek.num_params, active=True))


def family_of(model: nn.Module) -> str:
    """The family of a model built by one of MODELS' classes. Where one class serves several families (Llama 2
    and 3.x; Qwen2, Qwen3 and Qwen3-MoE) its hf module's `family_of(args)` names the one its hyper-parameters are."""
    matches = [name for name, spec in MODELS.items() if type(model) is spec.model_cls]
    if not matches:
        raise TypeError(f"{type(model).__name__} is not a model class of ember's families")
    hf = MODELS[matches[0]].hf
    return hf.family_of(model.args) if len(matches) > 1 else matches[0]


def not_a_hyperparameter(key: str, family: str, fields: set[str]) -> str:
    """The error for `model.<key>` that `family` has no field for, offering the fields a user can set (a config key)."""
    from ember.config_schema import ModelConfig

    settable = sorted(fields & {f.name for f in dataclasses.fields(ModelConfig)})
    return f"model.{key} is not a hyper-parameter of {family} (its keys: {', '.join(settable)})"


def build_model_args(family: str, flavor: str, overrides: dict[str, Any] | None = None) -> Any:
    """The flavor's hyper-parameters with the user's `model.<field>` overrides (None: keep) applied."""
    if family not in MODELS:
        raise ConfigError(f"unknown model.family '{family}'{did_you_mean(family, MODELS)}; choose from "
                          f"{', '.join(MODELS)}")
    spec = MODELS[family]
    if flavor not in spec.flavors:
        raise ConfigError(f"unknown model.flavor '{flavor}' for family '{family}' "
                         f"(choose from {', '.join(spec.flavors)})")
    keys = getattr(spec.args_cls, "CONFIG_KEYS", {})  # config key -> field, where they differ
    fields = {f.name for f in dataclasses.fields(spec.args_cls)} - set(keys.values()) | set(keys)
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ConfigError(not_a_hyperparameter(unknown[0], family, fields))
    moe_keys = sorted({"moe_hidden_dim", "norm_topk_prob", "sparse_step", "top_k"} & set(overrides))
    if spec.hf is qwen.hf and family != "qwen3_moe" and moe_keys:
        raise ConfigError(f"model.{moe_keys[0]} is a Qwen3-MoE hyper-parameter, and {family} has no experts; "
                          "use model.family=qwen3_moe")
    overrides = {keys.get(k, k): v for k, v in overrides.items()}
    args = dataclasses.replace(spec.flavors[flavor], **overrides)
    if spec.hf is qwen.hf and qwen.hf.family_of(args) != family and (family == "qwen3_moe" or args.n_experts):
        raise ConfigError(f"model.n_experts={args.n_experts} does not fit model.family={family}: experts make "
                          "qwen3_moe, and qwen2/qwen3 are dense; choose the family that has them")
    checks.check_args(args, spec.flavors[flavor])  # the floors and the family's own rules, as the loader's
    explicit = getattr(args, "head_dim_override", None)
    if explicit is not None and (explicit <= 0 or explicit % 2):
        raise ConfigError(f"model.head_dim={explicit} must be a positive even number (RoPE rotates pairs of it)")
    if explicit is not None and explicit * args.n_heads == args.dim:  # the derived width, stated: one model, one form
        args = dataclasses.replace(args, head_dim_override=None)
    mla = spec.hf is deepseek.hf  # MLA's heads are sized by its own keys (DeepseekArgs.validate), not by dim
    if not mla and ((explicit is None and args.dim % args.n_heads) or args.n_heads % args.kv_heads or args.head_dim % 2):
        raise ConfigError(f"model.dim={args.dim} must split into model.n_heads={args.n_heads} heads of even size "
                          f"(or set model.head_dim), and n_heads must be a multiple of "
                          f"model.n_kv_heads={args.kv_heads}")
    window = getattr(args, "sliding_window", None)  # >= 1 where set, like every size (checks.int_floors)
    for key in ("attn_scale", "route_scale"):  # Llama 4's temperature slope, DeepSeek's routed_scaling_factor
        value = getattr(args, key, None)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"model.{key}={value} must be a finite number >= 0")
    first_windowed = getattr(args, "max_window_layers", 0)
    if first_windowed < 0 or (first_windowed and window is None) or (window is not None and first_windowed >= args.n_layers):
        raise ConfigError(f"model.max_window_layers={first_windowed} must be the first layer with the sliding window: "
                          f">= 0, below model.n_layers={args.n_layers}, and with model.sliding_window set")
    return args
