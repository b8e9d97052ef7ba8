"""Typed job configuration: recipes (YAML) and `key=value` overrides into the dataclass sections of
ember/config_schema.py.

OmegaConf does the parsing and the type checking (structured configs from these dataclasses); this
file adds what users of the field expect on top: a recipe lookup, `did you mean` for unknown keys,
one-line errors, and the cross-field checks that need nothing but the config. It imports nothing of ember but
the schema (and its errors): the checks that need a feature's code live with that feature, and
ember.train.run.load_config runs them, before any work.
"""

from __future__ import annotations

import math
import os
import typing
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from ember.config_schema import (  # noqa: F401  the sections (ember/config_schema.py), importable from here
    CheckpointConfig,
    DataConfig,
    DPOConfig,
    EvalConfig,
    EvalOptions,
    EvalTask,
    Fp8Config,
    JobConfig,
    LoraConfig,
    MeshConfig,
    MetricsConfig,
    MixtureSource,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    ProfileConfig,
    ScheduleConfig,
)
from ember.errors import ConfigError, did_you_mean, first_error_line, not_one_of
from ember.overrides import ALIASES, IMPLIED, alias_overrides, list_of_keys, parse_overrides

RECIPES_DIR = Path(__file__).parent / "recipes"

PRECISIONS = ("auto", "fp32", "bf16", "fp8")
FP8_RECIPES = ("tensorwise", "rowwise")  # ember.parallel.fp8.RECIPES (config stays importable without torch)
NOT_HYPERPARAMETERS = ("family", "flavor", "remat", "remat_every", "scan_layers", "init_from", "aux_loss_coef",
                       "z_loss_coef", "bias_update_rate")  # model.* keys that are not model args
CP_IMPLS = ("auto", "allgather", "ring")
DEVICES = ("auto", "cpu", "cuda", "tpu", "xla")
XLA_DEVICES = ("tpu", "xla")  # the jax path (ember/xla/), every other device the torch.distributed one
# `ember eval`'s eval.* keys that training's eval section has not (ppl's window)
EVAL_COMMAND_KEYS = tuple(f"eval.{name}" for name in EvalOptions.__dataclass_fields__
                          if name not in EvalConfig.__dataclass_fields__)


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def resolve_recipe(recipe: str) -> Path:
    """A built-in recipe name, or a path to a YAML file (e.g. OUTPUT_DIR/config.yaml)."""
    builtin = RECIPES_DIR / f"{recipe}.yaml"
    if builtin.is_file():
        return builtin
    path = Path(recipe)
    if path.is_file():
        return path
    if recipe.endswith((".yaml", ".yml")) or "/" in recipe:
        raise ConfigError(f"recipe file '{recipe}' not found (give an existing YAML path or a built-in recipe name)")
    raise ConfigError(f"unknown recipe '{recipe}'{did_you_mean(recipe, recipe_names())}; built-in recipes: "
                      f"{', '.join(recipe_names())} (see `ember recipes`)")


def _all_keys(node: Any, prefix: str = "") -> list[str]:
    keys = []
    for key, value in node.items():
        dotted = f"{prefix}{key}"
        keys.append(dotted)
        if isinstance(value, DictConfig):
            keys.extend(_all_keys(value, dotted + "."))
    return keys


def _explain(err: OmegaConfBaseException, schema: type, origin: str, unknown_hint: str = "") -> ConfigError:
    """Turn an OmegaConf exception into the one-line message the CLI prints. `schema`: the dataclass merged into
    (JobConfig, or a command's own, such as `ember eval`'s), whose keys an unknown one is compared with;
    `unknown_hint`: what that message adds (the keys a command takes)."""
    key = getattr(err, "full_key", None) or "?"
    where = f" in {origin}" if origin else ""
    if isinstance(err, ConfigKeyError):
        if key in EVAL_COMMAND_KEYS:  # ppl's window: a key of `ember eval`, where it means something
            return ConfigError(f"'{key}' is a key of `ember eval` (the ppl window), not of training{where}; "
                               "training's eval section has eval.tasks, eval.limit and eval.batch_size")
        known = _all_keys(OmegaConf.structured(schema))
        return ConfigError(f"unknown config key '{key}'{did_you_mean(key, known)}{where}{unknown_hint}")
    if isinstance(err, ValidationError):
        # OmegaConf's own words name its classes ("converted to Integer", "ListConfig"), not the schema's types:
        # the value as read and the key's declared type say it in the user's terms.
        detail = f"got {err.value!r}" if hasattr(err, "value") else first_error_line(err)
        expected = _type_name(key, schema)
        if "is not a ListConfig" in first_error_line(err):
            expected += f": write {key}=[A,B]"
        return ConfigError(f"bad value for config key '{key}'{where}: {detail} (expected {expected})")
    return ConfigError(f"invalid config{where}: {first_error_line(err)}")


def _type_name(key: str, schema: type = JobConfig) -> str:
    """The declared type of a dotted key, as a user reads it: 'float', 'int or null', 'list[float]'."""
    section: Any = schema
    try:
        for part in key.split("."):
            name, index, _ = part.partition("[")
            section = typing.get_type_hints(section)[name]
            if index:  # a list's element (optim.betas[0]): the list's item type
                section = typing.get_args(section)[0]
    except (KeyError, TypeError, IndexError):
        return "the declared type"
    args = [a for a in typing.get_args(section) if a is not type(None)]
    if typing.get_origin(section) is typing.Union and len(args) == 1:
        return f"{getattr(args[0], '__name__', args[0])} or null"
    return getattr(section, "__name__", str(section)) if typing.get_origin(section) is None else str(section)


def _load_yaml(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"recipe file '{path}' is not UTF-8 text") from None
    try:
        data = yaml.safe_load(text)  # safe loading: a recipe is data, never code
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"recipe file '{path}' is not valid YAML{where}; fix the syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"recipe file '{path}' must hold a mapping of config keys, not {type(data).__name__}")
    return data


def _reject_env_interpolation(node: Any, origin: str) -> None:
    # Secrets live in the environment and must never be copied into config.yaml, so the `oc.env`
    # resolver (which would do exactly that when the resolved config is saved) is refused.
    for key, value in node.items() if isinstance(node, dict) else []:
        if isinstance(value, dict):
            _reject_env_interpolation(value, origin)
        elif isinstance(value, str) and "${oc.env" in value.replace(" ", ""):
            raise ConfigError(f"config key '{key}' in {origin} reads the environment; "
                              "pass secrets as env vars, not config")


def _alias_recipe(data: dict) -> dict:
    for alias, target in ALIASES.items():
        *section, key = alias.split(".")
        holder = data.get(section[0]) if section else data
        if isinstance(holder, dict) and key in holder:
            value = holder.pop(key)
            *target_section, target_key = target.split(".")
            data.setdefault(target_section[0], {})[target_key] = value
            if alias in IMPLIED:
                implied_section, implied_key = IMPLIED[alias][0].split(".")
                data.setdefault(implied_section, {})[implied_key] = True
    return data


def load(recipe: str = "debug", overrides: Optional[list[str]] = None) -> JobConfig:
    """Recipe (built-in name or YAML path) + `key=value` overrides -> a JobConfig, its types and the checks that
    need nothing but the config done (`validate`). ember.train.run.load_config adds the features' checks: what a
    command runs on."""
    path = resolve_recipe(recipe)
    recipe_data = _alias_recipe(_load_yaml(path))
    if isinstance(recipe_data.get("resume_allow_changes"), str):  # one key, as list_of_keys makes an override's
        recipe_data["resume_allow_changes"] = [recipe_data["resume_allow_changes"]]
    merged = merge_file(OmegaConf.structured(JobConfig), recipe_data, f"recipe '{path}'")
    cfg: JobConfig = apply_overrides(merged, list(overrides or []))
    validate(cfg)
    return cfg


def merge_file(base: DictConfig, data: dict, origin: str) -> DictConfig:
    """A mapping read from a file (a recipe, a run's config.yaml) merged into `base`, a structured config of one of
    the schema's dataclasses; a bad key or value is one line naming it and `origin`."""
    _reject_env_interpolation(data, origin)
    try:
        return OmegaConf.merge(base, OmegaConf.create(data))
    except OmegaConfBaseException as err:
        raise _explain(err, OmegaConf.get_type(base), origin) from None


def apply_overrides(base: DictConfig, overrides: list[str], unknown_hint: str = "") -> Any:
    """The command line's `key=value` items (ember/overrides.py: aliases, a bare list key, flow mappings) merged
    into `base`, a structured config of one of the schema's dataclasses, and that dataclass made: the types
    checked once, by OmegaConf. Each mistake is one line: an unknown key with the closest known one (and
    `unknown_hint`), a value with the key's declared type, a list or mapping of the wrong shape."""
    overrides = [list_of_keys(item) for item in alias_overrides(overrides)]
    dotlist = parse_overrides(overrides)
    _reject_env_interpolation(OmegaConf.to_container(dotlist), "overrides")
    try:
        return OmegaConf.to_object(OmegaConf.merge(base, dotlist))
    except OmegaConfBaseException as err:
        raise _explain(err, OmegaConf.get_type(base), "", unknown_hint) from None
    except TypeError:  # OmegaConf's merge of a mapping into a list, or the reverse
        key = next(item.partition("=")[0] for item in overrides if "{" in item or "[" in item)
        raise ConfigError(f"override '{key}=...' has the wrong shape: a list is [a, b], a list of mappings "
                          f"[{{name: x, data: y}}], a mapping {{key: value}}; see the key's type in "
                          f"docs/training-and-config.md") from None


def _check_trackers(metrics: MetricsConfig) -> None:
    """metrics.wandb / metrics.mlflow need their package: said now, not after the model is built."""
    import importlib.util

    for key, package in (("wandb", "wandb"), ("mlflow", "mlflow")):
        if getattr(metrics, key) and importlib.util.find_spec(package) is None:
            raise ConfigError(f"metrics.{key}=true needs the {package} package: pip install '.[{key}]' (or "
                              f"pip install {package}), or set metrics.{key}=false")


def _check_output_dir(output_dir: str) -> None:
    """output_dir must be a directory ember can create and write in: found now, not after the model is built."""
    if "://" in output_dir and not output_dir.startswith("file://"):
        return  # a URL: ember/storage/location.py checks it, and its bucket before any work
    path = Path(output_dir.removeprefix("file://")).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"output_dir={output_dir} is a file, not a directory; choose another output_dir")
    existing = path
    while not existing.exists():  # the nearest existing ancestor is where the directory would be created
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"output_dir={output_dir}: {existing} is a file, so the directory cannot be created; "
                          "choose another output_dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"output_dir={output_dir}: {existing} is not writable; choose another output_dir")


TASKS = ("lm", "dpo", "grpo")  # task=dpo|grpo's own checks: ember/finetune/checks.py


def fp8_enabled(cfg: JobConfig) -> bool:
    return cfg.fp8.enabled or cfg.precision == "fp8"


def _check_fp8(cfg: JobConfig) -> None:
    if not fp8_enabled(cfg):
        if cfg.fp8.emulate:  # alone it would change nothing, and the run would look like an FP8 test
            raise ConfigError("fp8.emulate=true emulates FP8 training, which this run does not turn on: add "
                              "precision=fp8 (or fp8.enabled=true), or drop fp8.emulate")
        return
    if cfg.fp8.recipe not in FP8_RECIPES:
        raise not_one_of("fp8.recipe", cfg.fp8.recipe, FP8_RECIPES)
    if cfg.lora.rank:
        raise ConfigError("fp8 training converts the linears LoRA adapts; use precision=bf16 with lora.rank")
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("fp8 training needs torchao: pip install -e '.[fp8]' (with your torch on the same pip "
                          "line), or drop precision=fp8 / fp8.enabled")


def _check_resume_allow_changes(names: list[str]) -> None:
    """Each entry a config key or section: a misspelt one would allow nothing, and the resume be refused anyway."""
    known = _all_keys(OmegaConf.structured(JobConfig))
    for name in names:
        if name not in known:
            raise ConfigError(f"resume_allow_changes: '{name}' is not a config key or section"
                              f"{did_you_mean(name, known)}; "
                              "name keys as overrides do, e.g. [data.dataset,seed]")


def validate(cfg: JobConfig) -> None:
    """The checks that need nothing but the config: ranges, names and combinations of keys, each naming the keys
    to change. The checks that need a feature's code (data sources, eval tasks, the mesh against the model, LoRA)
    live with the feature; ember.train.run.load_config runs them after these."""
    for key in ("max_steps", "global_batch_size", "micro_batch_size", "seq_len", "logging_steps"):
        if getattr(cfg, key) <= 0:
            raise ConfigError(f"{key} must be positive, got {getattr(cfg, key)}")
    if cfg.precision not in PRECISIONS:
        raise not_one_of("precision", cfg.precision, PRECISIONS)
    _check_fp8(cfg)
    if cfg.device not in DEVICES:
        raise not_one_of("device", cfg.device, DEVICES)
    if cfg.optim.lr <= 0 or not math.isfinite(cfg.optim.lr):
        raise ConfigError(f"optim.lr must be a positive number, got {cfg.optim.lr}")
    if len(cfg.optim.betas) != 2 or not all(0 <= b < 1 for b in cfg.optim.betas):
        raise ConfigError(f"optim.betas must be two numbers in [0, 1), got {list(cfg.optim.betas)}")
    if cfg.schedule.warmup_steps < 0:
        raise ConfigError(f"schedule.warmup_steps must be >= 0, got {cfg.schedule.warmup_steps}")
    validate_data(cfg.data)
    if cfg.checkpoint.interval < 0 or cfg.checkpoint.keep < 0 or cfg.checkpoint.keep_every < 0:
        raise ConfigError("checkpoint.interval, checkpoint.keep and checkpoint.keep_every must be >= 0")
    _check_output_dir(cfg.output_dir)
    if cfg.eval.batch_size < 1:
        raise ConfigError(f"eval.batch_size must be >= 1, got {cfg.eval.batch_size}")
    peak = cfg.metrics.peak_tflops
    if peak is not None and not (math.isfinite(peak) and peak > 0):
        raise ConfigError(f"metrics.peak_tflops={peak}: a device's peak TFLOP/s is a finite number > 0 (null: the "
                          "table's, or on a CPU a measured one)")
    if cfg.eval.limit is not None and cfg.eval.limit < 1:
        raise ConfigError(f"eval.limit must be >= 1 (null: every row), got {cfg.eval.limit}")
    if cfg.resume not in ("auto", "none") and "://" not in cfg.resume and not Path(cfg.resume).expanduser().exists():
        raise ConfigError(f"resume={cfg.resume}: no such checkpoint; give a checkpoints/step-N path, auto or none")
    _check_resume_allow_changes(cfg.resume_allow_changes)
    if cfg.model.scan_layers and cfg.device not in XLA_DEVICES:
        raise ConfigError("model.scan_layers=true is the XLA path's (device=tpu or device=xla), "
                          f"not device={cfg.device}; drop model.scan_layers or set device=xla")
    if cfg.model.remat_every < 1:
        raise ConfigError(f"model.remat_every must be >= 1, got {cfg.model.remat_every}")
    for key in ("aux_loss_coef", "z_loss_coef", "bias_update_rate"):
        value = getattr(cfg.model, key)
        if not (value >= 0 and math.isfinite(value)):
            raise ConfigError(f"model.{key}={value} must be a finite number >= 0 (0 turns it off)")
    if cfg.task not in TASKS:
        raise not_one_of("task", cfg.task, TASKS)
    _check_trackers(cfg.metrics)
    if cfg.profile.step < 1 or cfg.profile.steps < 1:
        raise ConfigError(f"profile.step={cfg.profile.step} and profile.steps={cfg.profile.steps} must be >= 1 (the "
                          "first traced step, as logged, and how many)")
    if cfg.profile.enabled and cfg.profile.step > cfg.max_steps:
        raise ConfigError(f"profile.step={cfg.profile.step} is past max_steps={cfg.max_steps}: "
                          f"no step would be traced; choose profile.step in 1-{cfg.max_steps}")
    if cfg.lora.rank < 0:
        raise ConfigError(f"lora.rank must be >= 0 (0: LoRA off), got {cfg.lora.rank}")
    if cfg.parallel.cp_impl not in CP_IMPLS:
        raise not_one_of("parallel.cp_impl", cfg.parallel.cp_impl, CP_IMPLS)


def validate_data(data: DataConfig) -> None:
    """The data section's checks that need nothing else: those of `validate`, which `ember eval` runs on ppl's
    source too."""
    if data.num_workers not in (0, 1):
        raise ConfigError(f"data.num_workers={data.num_workers}: 0 reads batches in the training thread, 1 in one "
                          "background thread (one keeps ahead of the step; more would reorder samples); use 0 or 1")
    if data.prefetch < 1:
        raise ConfigError(f"data.prefetch={data.prefetch}: batches made ahead must be >= 1")
    for i, part in enumerate(data.mixture):
        if not (part.weight > 0 and math.isfinite(part.weight)):
            raise ConfigError(f"data.mixture[{i}] ({part.source}) has weight {part.weight}; weights must be positive")
    if data.streaming and (data.mixture or data.dataset in ("synthetic", "embedded")):
        raise ConfigError("data.streaming=true streams a hub dataset or local files (data.dataset); the embedded "
                          "corpus, synthetic data and mixtures are read without it: set data.streaming=false")
    if data.document_mask and data.dataset == "synthetic" and not data.mixture:
        raise ConfigError("data.document_mask needs documents; synthetic tokens have none: "
                          "set data.document_mask=false")
    if data.prompt_field and data.streaming:
        raise ConfigError("data.prompt_field (SFT) reads whole files; set data.streaming=false")
    if data.mixture and data.dataset == "synthetic":
        raise ConfigError("data.mixture and data.dataset=synthetic exclude each other; drop one of them")


def model_overrides(model: ModelConfig) -> dict[str, Any]:
    """The model.* fields the user set, to apply on top of the flavor's hyper-parameters."""
    return {k: v for k, v in vars(model).items() if k not in NOT_HYPERPARAMETERS and v is not None}


def grad_accum_steps(cfg: JobConfig, dp_world: int) -> int:
    return cfg.global_batch_size // (cfg.micro_batch_size * dp_world)


def to_yaml(cfg: JobConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def dotted_keys(node: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A config as read from config.yaml -> {"optim.lr": 0.002, ...}: the names overrides use."""
    flat: dict[str, Any] = {}
    for key, value in node.items():
        if isinstance(value, dict) and value:
            flat.update(dotted_keys(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def save(cfg: JobConfig, path: Path) -> None:
    """Write the resolved config so `ember train PATH` repeats the run exactly."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(to_yaml(cfg), encoding="utf-8")
    tmp.replace(path)
