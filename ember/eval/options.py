"""`ember eval`'s arguments, every one checked before any work: the model, its tasks (`ppl`, `ppl=DATA`, the row
tasks `lambada`, `boolq`, `choice` with or without a jsonl file, the generative `gen=FILE`, or lm-eval's through
`--harness`), the options (--output, --tokenizer, the harness's own) and the `eval.*` / `data.*` / `gen.*` keys.

The keys take the config's path, not one of their own: ember.config.apply_overrides (ember/overrides.py's form,
OmegaConf's types, an unknown key with the closest known one) into one EvalCommandConfig (ember/config_schema.py),
whose eval section is training's EvalConfig with ppl's window and whose data section, when ppl is asked for, starts
from the run's own (its config.yaml) and is checked as training checks it (ember.config.validate_data). gen's keys
(ember/eval/generative.py's GenOptions) are a section beside them, starting from a GRPO run's own grpo.* values;
gen renders chat prompts with the run's data.chat_template, the one data.* key it reads."""

from __future__ import annotations

import argparse
import glob
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import OmegaConf

from ember.config import EVAL_COMMAND_KEYS, apply_overrides, merge_file, validate_data
from ember.config_schema import DataConfig, EvalCommandConfig
from ember.errors import ConfigError, UserFileNotFound, did_you_mean
from ember.eval.generative import GEN_KEYS, LIST_KEYS, GenOptions, check_options, run_defaults
from ember.eval.tasks import HUB, PPL_SPLITS, TASK_ROWS, TASKS, check_limit
from ember.launch.local import TORCHRUN_FLAGS, unknown_option
from ember.storage.location import Location, as_path, check_input, check_output

TASK_NAMES = ("ppl", *TASKS, "gen")
ROW_TASKS = "lambada, boolq, choice and gen"  # what eval.limit counts rows of
PPL_KEYS = EVAL_COMMAND_KEYS  # ppl's window: each needs a ppl task
EVAL_KEYS = ("eval.limit", "eval.batch_size", *PPL_KEYS)
HARNESS_OPTIONS = ("--include-path", "--limit", "--batch-size")  # with --harness only
OPTIONS = ("--output", "--tokenizer", "--harness", *HARNESS_OPTIONS)  # each takes a value
KEYS_HINT = f" for ember eval (keys: {', '.join(EVAL_KEYS)}, data.*, gen.*)"  # what an unknown key's line adds


@dataclass
class EvalKeys(EvalCommandConfig):
    """Every key=value `ember eval` takes: EvalCommandConfig's eval and data sections, and gen's."""

    gen: GenOptions = field(default_factory=GenOptions)


def split_mesh_keys(argv: list[str]) -> tuple[list[str], dict[str, dict[str, int]]]:
    """The `ici_mesh.AXIS=N` / `dcn_mesh.AXIS=N` items out of argv, parsed."""
    from ember.eval.distributed import eval_mesh_overrides

    mesh_items = [a for a in argv if a.startswith(("ici_mesh.", "dcn_mesh.")) and "=" in a]
    return [a for a in argv if a not in mesh_items], eval_mesh_overrides(mesh_items)


def parse(items: list[str]) -> argparse.Namespace:
    """The arguments after the launcher flags and the mesh keys: either the harness's (`harness` set) or the
    tasks' (`path`, `tasks` {task: data or None}, `options` EvalOptions with the run's defaults filled in, `data`
    the DataConfig of ppl and gen or None, `gen` GenOptions or None, `output`, `tokenizer`)."""
    _check_options(items)
    if any(item.partition("=")[0] == "--harness" for item in items):
        return _parse_harness(items)
    return _parse_tasks(items)


def _check_options(items: list[str]) -> None:
    """Every option among `items` is one of ember eval's (a launcher flag after PATH is told where it goes)."""
    expect_value = False
    for item in items:
        name = item.partition("=")[0]
        if expect_value:  # the value of the option before it, whatever it looks like
            expect_value = False
        elif name in OPTIONS:
            expect_value = "=" not in item
        elif name.replace("_", "-") in TORCHRUN_FLAGS:
            raise ConfigError(f"{name} is a launcher option: give it before PATH (ember eval {name} N PATH ...)")
        elif item.startswith("--"):
            raise unknown_option(name, "eval", (*OPTIONS, *TORCHRUN_FLAGS))


def _parse_harness(items: list[str]) -> argparse.Namespace:
    """`PATH --harness TASK[,TASK] [--include-path DIR] [--limit N] [--batch-size N] [--output F] [--tokenizer F]`;
    the task names are lm-eval's, checked against its registry when the command runs (before the model loads)."""
    from ember.eval.scoring import check_batch_size
    from ember.usage import ArgumentParser

    parser = ArgumentParser(prog="ember eval PATH --harness", help_hint="ember eval --help")
    parser.add_argument("path")
    parser.add_argument("--harness", required=True, help="comma-separated lm-eval task names")
    parser.add_argument("--include-path", default=None, help="a folder of task YAMLs (local tasks, offline)")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--output", default=None)
    parser.add_argument("--tokenizer", default=None)
    args = parser.parse_args(items)
    check_locations(args.path, args.output, args.tokenizer)
    check_limit(args.limit, "--limit")
    check_batch_size(args.batch_size, "--batch-size")
    return args


def _parse_tasks(items: list[str]) -> argparse.Namespace:
    """`PATH TASK[=DATA] ... [eval.KEY=V ...] [data.KEY=V ...] [--output F] [--tokenizer F]`, in any order after
    PATH: each task once, each key applying to a task of the command."""
    rest = list(items)
    path: Optional[str] = None
    tasks: dict[str, Optional[str]] = {}
    keys: list[str] = []
    output = tokenizer = None
    while rest:
        item = rest.pop(0)
        name, eq, value = item.partition("=")
        if name in ("--output", "--tokenizer"):
            if not eq and not rest:
                raise ConfigError(f"{item} needs a value")
            value = value if eq else rest.pop(0)
            output, tokenizer = (value, tokenizer) if name == "--output" else (output, value)
        elif name in HARNESS_OPTIONS:
            raise ConfigError(f"{name} is an option of --harness (lm-eval tasks); ember's own tasks take eval.limit=N "
                              "and eval.batch_size=N")
        elif path is None:
            path = item
        elif name in TASK_NAMES:
            if (eq and not value) or (name == "gen" and not eq):
                raise ConfigError(f"'{item}' names no data; give {name}=FILE" + (
                    " (.jsonl, .json or .parquet rows of prompts) or gen=reasoning_gym:NAME" if name == "gen" else
                    "" if name == "choice" else f" or {name} alone"))
            if name in tasks:  # eval.json keeps one entry per task
                raise ConfigError(f"{name} is given twice ({tasks[name] or name}, {value or name}); eval.json holds "
                                  f"one {name} entry: run one `ember eval` per data, each with its own --output FILE")
            tasks[name] = value or None
        elif name.startswith(("eval.", "data.", "gen.")) and eq:
            # one value of a list key is a list of one (gen.rewards=math)
            keys.append(f"{name}=[{value}]" if name in LIST_KEYS and not value.strip().startswith("[") else item)
        else:
            known = (*TASK_NAMES, *EVAL_KEYS, *(f"data.{key}" for key in DataConfig.__dataclass_fields__), *GEN_KEYS)
            raise ConfigError(f"unknown eval task or key '{item}'{did_you_mean(name, known)} (tasks: "
                              f"{', '.join(TASK_NAMES)}; keys: {', '.join(EVAL_KEYS)}, data.*, gen.*)")
    if path is None:
        raise ConfigError("name the model to evaluate: ember eval PATH TASK[=DATA] ... (see ember eval --help)")
    check_locations(path, output, tokenizer)
    _check_combination(tasks, [item.partition("=")[0] for item in keys])
    cfg = _resolve_keys(path, tasks, keys)
    return argparse.Namespace(harness=None, path=path, tasks=tasks, options=cfg.eval,
                              data=cfg.data if {"ppl", "gen"} & set(tasks) else None,
                              gen=cfg.gen if "gen" in tasks else None, output=output, tokenizer=tokenizer)


def check_locations(path: str, output: Optional[str], tokenizer: Optional[str]) -> None:
    """PATH, --output and --tokenizer given as URLs: reachable (the bucket, the credentials, the endpoint), PATH and
    --tokenizer there; one line each, before anything is read or loaded."""
    check_input(path, "path")
    check_output(output, "--output")
    check_input(tokenizer, "--tokenizer")


def _check_combination(tasks: dict[str, Optional[str]], given: list[str]) -> None:
    """Each key applies to a task of the command, and ppl's data is named once."""
    if "eval.tasks" in given:
        raise ConfigError("eval.tasks is the training config's list; name ember eval's tasks as arguments "
                          "(ppl, lambada=FILE, boolq=FILE, choice=FILE, gen=FILE)")
    if not tasks:
        raise ConfigError("name at least one task: ppl, ppl=DATA, lambada=FILE, boolq=FILE, choice=FILE or gen=FILE")
    if "ppl" not in tasks:
        # gen reads one key of the data section: how its chat prompts are rendered
        unused = [key for key in given if key in PPL_KEYS] + [
            key for key in given if key.startswith("data.") and ("gen" not in tasks or key != "data.chat_template")]
        if unused:
            raise ConfigError(f"{unused[0]} is a key of ppl, and no ppl task is given"
                              + ("; gen reads data.chat_template only" if "gen" in tasks else ""))
    if "gen" not in tasks and any(key.startswith("gen.") for key in given):
        raise ConfigError(f"{next(k for k in given if k.startswith('gen.'))} is a key of gen, and no gen task is "
                          "given (gen=FILE)")
    if set(tasks) == {"ppl"} and "eval.limit" in given:
        raise ConfigError(f"eval.limit counts rows of {ROW_TASKS}; ppl is bounded by eval.max_tokens")
    if tasks.get("ppl") and "data.dataset" in given:
        raise ConfigError("ppl=DATA and data.dataset both name ppl's data; give one")


def _resolve_keys(path: str, tasks: dict[str, Optional[str]], keys: list[str]) -> EvalKeys:
    """The eval.*, data.* and gen.* keys in one merge (ppl=DATA as data.dataset=DATA) over the defaults and, for
    ppl and gen, the run's data section (and a GRPO run's generation keys for gen); then the checks of the values:
    the eval numbers, ppl's source, the data section as training checks it, gen's keys. ppl's window and split
    defaults filled in: the run's seq_len, val (all for ppl=DATA)."""
    base = OmegaConf.structured(EvalKeys)
    config_yaml = run_config_yaml(as_path(path)) if {"ppl", "gen"} & set(tasks) else None
    run: dict[str, Any] = _read_yaml(config_yaml) if config_yaml else {}
    if config_yaml:  # a missing section, or an older run's key, is said naming the file
        base = merge_file(base, {"data": run.get("data") or {}}, str(config_yaml))
        if "gen" in tasks:
            base = merge_file(base, {"gen": run_defaults(run)}, str(config_yaml))
    dataset = [f"data.dataset={tasks['ppl']}"] if tasks.get("ppl") else []
    cfg: EvalKeys = apply_overrides(base, keys + dataset, KEYS_HINT)
    _check_numbers(cfg)
    if "gen" in tasks:
        from ember.data.chat import TEMPLATE_CHOICES

        check_options(cfg.gen, tasks["gen"], run)
        if cfg.data.chat_template not in TEMPLATE_CHOICES:
            raise ConfigError(f"data.chat_template '{cfg.data.chat_template}' is not one of "
                              f"{', '.join(TEMPLATE_CHOICES)}")
    if "ppl" in tasks:
        named = "ppl" if dataset else "data.dataset" if any(k.startswith("data.dataset=") for k in keys) else None
        _check_ppl_source(path, cfg.data, config_yaml, named)
        validate_data(cfg.data)
        cfg.eval.split = cfg.eval.split or ("all" if tasks["ppl"] else "val")
        if cfg.eval.seq_len is None:
            cfg.eval.seq_len = _trained_seq_len(config_yaml)
    return cfg


def _check_numbers(cfg: EvalCommandConfig) -> None:
    """The eval section's values past their types: the numbers >= 1, eval.split one of PPL_SPLITS."""
    options = cfg.eval
    check_limit(options.limit, "eval.limit")
    for name in ("batch_size", "seq_len", "stride", "max_tokens"):
        number = getattr(options, name)
        if number is not None and number < 1:
            raise ConfigError(f"eval.{name} must be an integer >= 1, got {number}")
    if options.split is not None and options.split not in PPL_SPLITS:
        raise ConfigError(f"eval.split must be one of {', '.join(PPL_SPLITS)}, got '{options.split}'")


def _check_ppl_source(path: str, data: DataConfig, config_yaml: Optional[Location], named: Optional[str]) -> None:
    """ppl's source is there: named on the command line (`named`: by ppl=DATA or data.dataset), or the run's own
    (never a silent default for a model that is no run); a relative path from the run's config.yaml said where it
    is read from."""
    from ember.data.sources import EMBEDDED, SYNTHETIC, check_source_exists, looks_like_path

    if not config_yaml and not named and _is_model(as_path(path)):
        raise ConfigError(f"plain ppl scores an ember run's own data (its config.yaml), and '{path}' is not an ember "
                          "run; name the text to score: ppl=DATA (a file, folder, glob or hub dataset) or "
                          "data.dataset=DATA")
    spec = data.dataset
    if config_yaml and not named and spec not in (EMBEDDED, SYNTHETIC) and not Path(spec).expanduser().is_absolute():
        # training writes data.dataset as given, so a relative path is read relative to the current directory
        missing = not glob.glob(spec) if glob.has_magic(spec) else not Path(spec).exists() and looks_like_path(spec)
        if missing:
            raise UserFileNotFound(f"data.dataset '{spec}' comes from {config_yaml} and is read relative to the "
                                   f"current directory ({Path.cwd()}), where it is not; run from the directory the "
                                   "run was started in, or pass data.dataset=ABSOLUTE_PATH")
    check_source_exists(spec, named or "data.dataset")


def check_task_rows(tasks: dict[str, Optional[str]]) -> None:
    """Every row of each local task file read and checked (fields, types): before the model loads (gen's rows,
    which its keys shape, by ember.eval.generative.read_rows)."""
    for task, data in tasks.items():
        if task not in ("ppl", "gen") and data not in (None, task, HUB.get(task, ("",))[0]):
            TASK_ROWS[task](data)


def data_label(spec: str, task: Optional[str] = None) -> str:
    """What eval.json records as a task's data: a local path made absolute, else the hub name."""
    local = Path(spec).expanduser()
    if local.exists():
        return str(local.resolve())
    if task in HUB and spec in (task, HUB[task][0]):
        return f"{HUB[task][0]} ({HUB[task][2]})"
    return spec


def run_config_yaml(path: Location) -> Optional[Location]:
    """The config.yaml of the run at `path` (the run's directory, or one of its checkpoints), if it has one; on
    an object store, read there."""
    return next((run / "config.yaml" for run in (path, path.parent.parent) if (run / "config.yaml").is_file()), None)


def _read_yaml(path: Location) -> dict:
    return yaml.safe_load(path.read_text()) or {}


def _is_model(path: Location) -> bool:
    """Whether `path` is something load_model reads (a file, or a directory of a model); its own errors say
    what else is wrong."""
    from ember.model_io.model_meta import MODEL_JSON

    return path.is_file() or any((path / name).exists() for name in (MODEL_JSON, "config.json", "checkpoints",
                                                                      "adapter_config.json"))


def _trained_seq_len(config_yaml: Optional[Location]) -> Optional[int]:
    seq_len = _read_yaml(config_yaml).get("seq_len") if config_yaml else None
    return seq_len if isinstance(seq_len, int) else None
