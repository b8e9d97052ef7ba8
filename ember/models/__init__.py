"""Model families: MODELS maps a `model.family` to what the trainer needs. A plain dict."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Callable, Generic, Optional, TypeVar

from torch import nn

from ember.errors import ConfigError, did_you_mean
from ember.models import checks, deepseek, gemma, glam, gpt, llama, llama4, mistral, mixtral, phi3, qwen
from ember.models.hf_mapping import HFMapping
from ember.nn.args import DecoderArgs
from ember.nn.decoder import Decoder

A = TypeVar("A", bound=DecoderArgs)  # the family's args class


@dataclass(frozen=True)
class ModelSpec(Generic[A]):
    name: str  # the family, as `model.family` names it
    flavors: Mapping[str, A]  # flavor name -> its published hyper-parameters
    model_cls: Callable[..., Decoder]  # model_cls(args[, moe=MoEOptions]) -> the model; build it on the meta device
    args_cls: type[A]
    # loss_parallel -> (model-level, per-block) tensor-parallel plans (module name -> ParallelStyle);
    # ember/parallel/parallelize.py applies it with every other parallelism
    tp_plan: Callable[[bool], tuple[dict[str, Any], dict[str, Any]]]
    flops_per_token: Callable[[A, int], float]  # (args, seq_len) -> training FLOPs per token
    hf: HFMapping[A]  # config and weight mapping to and from Hugging Face (the family's hf.py)
    # (model) -> the parameters one token passes through (a mixture of experts uses top_k of its experts);
    # None: every parameter (a dense family). `ember recipes` shows it as "active".
    active_params: Optional[Callable[[nn.Module], int]] = None
    # Where one args class serves several families: (family, the model.* keys the user set, the args they made) ->
    # None, or a ConfigError for args that are another family's (Qwen: experts make qwen3_moe)
    check_family: Optional[Callable[[str, Collection[str], A], None]] = None


MODELS: dict[str, ModelSpec[Any]] = {
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
                               active_params=functools.partial(qwen.num_params, active=True),
                               check_family=qwen.check_family)
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


def build_model_args(family: str, flavor: str, overrides: Optional[dict[str, Any]] = None) -> DecoderArgs:
    """The flavor's hyper-parameters with the user's `model.<field>` overrides (None: keep) applied, held to the
    family's rules (models/checks.py: the floors and its args' validate())."""
    if family not in MODELS:
        raise ConfigError(f"unknown model.family '{family}'{did_you_mean(family, MODELS)}; choose from "
                          f"{', '.join(MODELS)}")
    spec = MODELS[family]
    if flavor not in spec.flavors:
        raise ConfigError(f"unknown model.flavor '{flavor}' for family '{family}' "
                         f"(choose from {', '.join(spec.flavors)})")
    keys = spec.args_cls.CONFIG_KEYS  # config key -> field, where they differ
    fields = {f.name for f in dataclasses.fields(spec.args_cls)} - set(keys.values()) | set(keys)
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ConfigError(not_a_hyperparameter(unknown[0], family, fields))
    args = dataclasses.replace(spec.flavors[flavor], **{keys.get(k, k): v for k, v in overrides.items()})
    if spec.check_family is not None:
        spec.check_family(family, overrides.keys(), args)
    checks.check_args(args, spec.flavors[flavor])  # the floors and the family's own rules, as the loader's
    return args.canonical()
