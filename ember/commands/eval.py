"""`ember eval PATH TASK[=DATA] ... | --harness TASK[,TASK]`: the command-line side of ember.eval (its arguments,
the eval.json report). The eval.* keys are training's `eval` section (ember/config_schema.py's EvalConfig: limit,
batch_size, typed and defaulted once for both) with ppl's window added (EvalOptions), merged as the config is."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ember.commands import as_rank, wants_help, world_size
from ember.config_schema import DataConfig, EvalConfig
from ember.errors import ConfigError, UserFileNotFound, first_error_line
from ember.launch.local import LAUNCH_FLAGS, launch_local, split_launch_flags, unknown_option

USAGE = """usage: ember eval PATH TASK[=DATA] ... [key=value ...] [--output FILE] [--tokenizer FILE]
  PATH: an ember run or checkpoint, an HF directory or an `ember convert --to torch` file
  tasks: ppl (the run's data source, its validation split), ppl=DATA (all of DATA: a file, folder, glob or
         any data.dataset value), lambada=FILE.jsonl ({"text"}), boolq=FILE.jsonl ({"passage", "question",
         "answer": true/false}), choice=FILE.jsonl ({"context", "choices", "label"}, scored as context + " " +
         choice: no space of a choice's own); `lambada` / `boolq` alone: the hub dataset. Each task once per command.
  keys: eval.limit=N (the first N rows of each task, N >= 1; unset: all), eval.batch_size=N, eval.seq_len=N and
        eval.stride=N (ppl's window), eval.max_tokens=N (ppl), eval.split=val|train|all (ppl; default: val
        for the run's data, all for ppl=DATA), data.* (ppl's data source)
  writes eval.json next to the checkpoint (--output FILE elsewhere): {"model", "step", "results": {task:
  {metric: value, "data": what was scored}}}; a task run again replaces its own entry, the others stay
       ember eval PATH --harness TASK[,TASK] [--include-path DIR] [--limit N]
  lm-evaluation-harness tasks (pip install -e '.[eval]'); offline: local task YAMLs with dataset_path: json and
  absolute data_files, and HF_DATASETS_OFFLINE=1
       ember eval --nproc-per-node N [--nnodes M ...] PATH ... [ici_mesh.AXIS=N dcn_mesh.AXIS=N]
  a model sharded as in training (axes data, fsdp, tensor; default fsdp over every process); requests are
  shared out over the data ranks; the same results as one process. Plain `torchrun ... -m ember eval` works too."""


@dataclass
class EvalOptions(EvalConfig):
    """`ember eval`'s eval.* keys: training's eval section (its tasks are the command's TASK arguments instead)
    and ppl's window."""

    seq_len: Optional[int] = None  # default: the sequence length the run trained at (its config.yaml), else the model's
    stride: Optional[int] = None  # default: half of seq_len
    max_tokens: Optional[int] = None  # tokens scored (default: all)
    split: Optional[str] = None  # val | train | all; default: val for the run's data, all for ppl=DATA


PPL_KEYS = ("eval.seq_len", "eval.stride", "eval.max_tokens", "eval.split")  # each needs a ppl task
EVAL_KEYS = ("eval.limit", "eval.batch_size", *PPL_KEYS)
HARNESS_OPTIONS = ("--include-path", "--limit", "--batch-size")  # with --harness only
OPTIONS = ("--output", "--tokenizer", "--harness", *HARNESS_OPTIONS)  # each takes a value


def parse(argv: list[str]) -> argparse.Namespace:
    """The launcher flags, the mesh keys (`meshes`), and either the harness's arguments (`harness`) or the tasks
    with their options, every value checked before any work (in the launcher too, before any process starts)."""
    if wants_help(argv):
        print(USAGE)
        raise SystemExit(0)
    flags, rest = split_launch_flags(argv, "eval", OPTIONS)
    items, meshes = _split_mesh_keys(rest)
    if not items:  # no model to evaluate: how to call the command, as a usage error (on stderr)
        print(USAGE, file=sys.stderr)
        raise SystemExit(2)
    _check_options(items)
    harness = any(item.partition("=")[0] == "--harness" for item in items)
    args = _parse_harness_args(items) if harness else _parse_eval_args(items)
    args.flags, args.argv, args.meshes = flags, rest, meshes
    return args


def _check_options(items: list[str]) -> None:
    """Every option among `items` is one of ember eval's (a launcher flag after PATH is told where it goes)."""
    expect_value = False
    for item in items:
        name = item.partition("=")[0]
        if expect_value:  # the value of the option before it, whatever it looks like
            expect_value = False
        elif name in OPTIONS:
            expect_value = "=" not in item
        elif name.replace("_", "-") in LAUNCH_FLAGS:
            raise ConfigError(f"{name} is a launcher option: give it before PATH (ember eval {name} N PATH ...)")
        elif item.startswith("--"):
            raise unknown_option(name, "eval", (*OPTIONS, *LAUNCH_FLAGS))


def run(args: argparse.Namespace) -> int:
    if args.flags:
        from ember.eval.distributed import eval_mesh_shape

        # the mesh is checked against the world size here, before any process starts
        return launch_local(args.flags, "eval", args.argv, lambda world: eval_mesh_shape(args.meshes, world))
    return as_rank(lambda: _eval_harness(args) if args.harness else _eval_tasks(args))


def _eval_tasks(args: argparse.Namespace) -> int:
    """The TASK[=DATA] arguments scored, the results merged into eval.json."""
    from ember.eval import TASKS, ppl
    from ember.eval.results import eval_json_target, read_previous, write_results
    from ember.eval.tasks import HUB, TASK_ROWS
    from ember.generate import tokenizer_for

    path, tasks, options = args.path, args.tasks, args.options
    data_cfg = _eval_data_config(path, tasks.get("ppl"), args.data_overrides) if "ppl" in tasks else None
    for task, data in tasks.items():  # every local row checked before the model loads
        if task != "ppl" and data not in (None, task, HUB.get(task, ("",))[0]):
            TASK_ROWS[task](data)
    target = eval_json_target(Path(path), args.output)
    read_previous(target, Path(path))  # a file we may not add to stops us before any work
    model, ranks = _load(path, args.meshes)
    tokenizer = tokenizer_for(path, args.tokenizer)  # a torch file's error says how to get the run's
    seq_len = options.seq_len if options.seq_len is not None else _trained_seq_len(Path(path))
    results: dict[str, dict] = {}
    for task, data in tasks.items():
        if task == "ppl":
            split = options.split or ("all" if data else "val")
            metrics = ppl(model, tokenizer, data_cfg, split, seq_len, options.stride, options.max_tokens,
                          options.batch_size, ranks)
            results["ppl"] = {**metrics, "data": _data_label(data_cfg.dataset), "split": split}
        else:
            metrics = TASKS[task](model, tokenizer, data or task, options.limit, options.batch_size, ranks)
            results[task] = {**metrics, "data": _data_label(data or task, task)}
    if _is_main():
        write_results(Path(path), results, target)
    return 0


def _data_label(spec: str, task: Optional[str] = None) -> str:
    """What eval.json records as a task's data: a local path made absolute, else the hub name."""
    from ember.eval.tasks import HUB

    local = Path(spec).expanduser()
    if local.exists():
        return str(local.resolve())
    if task in HUB and spec in (task, HUB[task][0]):
        return f"{HUB[task][0]} ({HUB[task][2]})"
    return spec


def _split_mesh_keys(argv: list[str]) -> tuple[list[str], dict[str, dict[str, int]]]:
    """The `ici_mesh.AXIS=N` / `dcn_mesh.AXIS=N` items out of argv, parsed."""
    from ember.eval.distributed import eval_mesh_overrides

    mesh_items = [a for a in argv if a.startswith(("ici_mesh.", "dcn_mesh.")) and "=" in a]
    return [a for a in argv if a not in mesh_items], eval_mesh_overrides(mesh_items)


def _load(path: str, meshes: dict[str, dict[str, int]]) -> tuple[Any, Any]:
    """The model and this process's EvalRanks: on one process load_model; under torchrun (or with mesh keys)
    sharded over the mesh."""
    from ember.eval.distributed import EvalRanks
    from ember.eval.sharded import load_sharded
    from ember.load import load_model

    if world_size() > 1 or any(meshes.values()):
        model, ranks = load_sharded(path, meshes)
        if _is_main():
            print(f"model sharded over {ranks.layout}; requests shared over {ranks.dp_world} data-parallel ranks")
        return model, ranks
    return load_model(path), EvalRanks()


def _is_main() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def _parse_harness_args(argv: list[str]) -> argparse.Namespace:
    """`ember eval PATH --harness TASK[,TASK] [--include-path DIR] [--limit N] [--output FILE] [--tokenizer F]`."""
    from ember.eval.scoring import check_batch_size
    from ember.eval.tasks import check_limit
    from ember.usage import ArgumentParser

    parser = ArgumentParser(prog="ember eval PATH --harness", help_hint="ember eval --help")
    parser.add_argument("path")
    parser.add_argument("--harness", required=True, help="comma-separated lm-eval task names")
    parser.add_argument("--include-path", default=None, help="a folder of task YAMLs (local tasks, offline)")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--output", default=None)
    parser.add_argument("--tokenizer", default=None)
    args = parser.parse_args(argv)
    check_limit(args.limit, "--limit")
    check_batch_size(args.batch_size, "--batch-size")
    return args


def _eval_harness(args: argparse.Namespace) -> int:
    """lm-evaluation-harness tasks through ember.eval.harness.EmberLM, the results merged into eval.json."""
    from ember.eval.harness import EmberLM, simple_evaluate, task_manager
    from ember.eval.results import eval_json_target, read_previous, write_results
    from ember.generate import tokenizer_for

    target = eval_json_target(Path(args.path), args.output)
    read_previous(target, Path(args.path))
    tasks = args.harness.split(",")
    manager = task_manager(tasks, args.include_path)  # a task name lm-eval does not know stops us before the model
    model, ranks = _load(args.path, args.meshes)
    tokenizer = tokenizer_for(args.path, args.tokenizer)
    lm = EmberLM(model, tokenizer, batch_size=args.batch_size, ranks=ranks)
    out = simple_evaluate(lm, tasks, limit=args.limit, manager=manager)
    if not _is_main():  # lm-eval returns the results on the first process only (its convention under torchrun)
        return 0
    if out is None or not out.get("results"):
        raise ConfigError(f"lm-eval ran no task of '{args.harness}' (check the names and --include-path)")
    data = "lm-eval" + (f" --include-path {Path(args.include_path).resolve()}" if args.include_path else "")
    results = {task: {**{key.split(",")[0]: value for key, value in metrics.items()
                         if isinstance(value, (int, float)) and not isinstance(value, bool)}, "data": data}
               for task, metrics in out["results"].items()}
    write_results(Path(args.path), results, target)
    return 0


def _parse_eval_args(argv: list[str]) -> argparse.Namespace:
    """path, tasks ({task: data or None}), options (EvalOptions), data_overrides (data.* items), output and
    tokenizer, every value checked: each task once, each key applying to a task of the command, numbers >= 1."""
    from ember.eval import TASKS

    rest = list(argv)
    path: Optional[str] = None
    tasks: dict[str, Optional[str]] = {}
    eval_items: list[str] = []
    data_overrides: list[str] = []
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
        elif name in ("ppl", *TASKS):
            if eq and not value:
                raise ConfigError(f"'{item}' names no data; give {name}=FILE" + ("" if name == "choice" else
                                                                                   f" or {name} alone"))
            if name in tasks:  # eval.json keeps one entry per task
                raise ConfigError(f"{name} is given twice ({tasks[name] or name}, {value or name}); eval.json holds "
                                  f"one {name} entry: run one `ember eval` per data, each with its own --output FILE")
            tasks[name] = value or None
        elif name.startswith("eval.") and eq:
            eval_items.append(item)
        elif name.startswith("data.") and eq:
            data_overrides.append(item)
        else:
            raise ConfigError(f"unknown eval task or key '{item}' (tasks: ppl, {', '.join(TASKS)}; keys: "
                              f"{', '.join(EVAL_KEYS)}, data.*)")
    options = _eval_options(eval_items)
    given = [item.partition("=")[0] for item in eval_items]
    if path is None:
        raise ConfigError("name the model to evaluate: ember eval PATH TASK[=DATA] ... (see ember eval --help)")
    if not tasks:
        raise ConfigError("name at least one task: ppl, ppl=DATA, lambada=FILE, boolq=FILE or choice=FILE")
    if "ppl" not in tasks:
        unused = [k for k in given if k in PPL_KEYS] + [o.partition("=")[0] for o in data_overrides]
        if unused:
            raise ConfigError(f"{unused[0]} is a key of ppl, and no ppl task is given")
    if set(tasks) == {"ppl"} and "eval.limit" in given:
        raise ConfigError("eval.limit counts rows of lambada, boolq and choice; ppl is bounded by eval.max_tokens")
    if tasks.get("ppl") and any(o.startswith("data.dataset=") for o in data_overrides):
        raise ConfigError("ppl=DATA and data.dataset both name ppl's data; give one")
    return argparse.Namespace(harness=None, path=path, tasks=tasks, options=options, data_overrides=data_overrides,
                              output=output, tokenizer=tokenizer)


def _eval_options(items: list[str]) -> EvalOptions:
    """The eval.KEY=VALUE items merged into EvalOptions by OmegaConf, as the config merges its overrides (types,
    null for unset), then checked: eval.split one of PPL_SPLITS, the numbers >= 1. One line names a bad key."""
    import difflib

    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

    from ember.eval.tasks import PPL_SPLITS, check_limit

    merged = OmegaConf.structured(EvalOptions)
    for item in items:
        key, _, value = item.partition("=")
        if key == "eval.tasks":
            raise ConfigError("eval.tasks is the training config's list; name ember eval's tasks as arguments "
                              "(ppl, lambada=FILE, boolq=FILE, choice=FILE)")
        try:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item[len("eval."):]]))
        except ConfigKeyError:
            hint = difflib.get_close_matches(key, EVAL_KEYS, n=1, cutoff=0.6)
            raise ConfigError(f"unknown config key '{key}'" + (f" (did you mean '{hint[0]}'?)" if hint else "")
                              + f" for ember eval (keys: {', '.join(EVAL_KEYS)}, data.*)") from None
        except OmegaConfBaseException:  # only the numbers can be mistyped: eval.split takes any text
            raise ConfigError(f"{key} must be an integer >= 1, got '{value}'") from None
    options: EvalOptions = OmegaConf.to_object(merged)  # type: ignore[assignment]
    check_limit(options.limit, "eval.limit")
    for name in ("batch_size", "seq_len", "stride", "max_tokens"):
        number = getattr(options, name)
        if number is not None and number < 1:
            raise ConfigError(f"eval.{name} must be an integer >= 1, got {number}")
    if options.split is not None and options.split not in PPL_SPLITS:
        raise ConfigError(f"eval.split must be one of {', '.join(PPL_SPLITS)}, got '{options.split}'")
    return options


def _eval_data_config(path: str, dataset: Optional[str], overrides: list[str]) -> DataConfig:
    """The data section ppl reads: the run's own (its config.yaml), with data.* overrides and `dataset` (ppl=DATA)."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    base = OmegaConf.structured(DataConfig)
    config_yaml = _run_config_yaml(Path(path))
    named = dataset or any(o.startswith("data.dataset=") for o in overrides)
    if not config_yaml and not named and _is_model(Path(path)):  # no run data to default to: never a silent one
        raise ConfigError(f"plain ppl scores an ember run's own data (its config.yaml), and '{path}' is not an ember "
                          "run; name the text to score: ppl=DATA (a file, folder, glob or hub dataset) or "
                          "data.dataset=DATA")
    dotlist = [o[len("data."):] for o in overrides] + ([f"dataset={dataset}"] if dataset else [])
    try:
        if config_yaml:
            base = OmegaConf.merge(base, (yaml.safe_load(config_yaml.read_text()) or {}).get("data", {}))
        base = OmegaConf.merge(base, OmegaConf.from_dotlist(dotlist))
        data_cfg = OmegaConf.to_object(base)
    except OmegaConfBaseException as err:
        raise ConfigError(f"bad data key for ppl: {first_error_line(err)}") from None
    if not named and config_yaml:
        _check_run_dataset(data_cfg.dataset, config_yaml)
    return data_cfg


def _check_run_dataset(spec: str, config_yaml: Path) -> None:
    """The run's data.dataset as training wrote it (as given), so a relative path is read relative to the current
    directory: where it is not there, say where it came from and how to point at it."""
    import glob

    from ember.data.sources import EMBEDDED, SYNTHETIC, looks_like_path

    local = Path(spec).expanduser()
    if spec in (EMBEDDED, SYNTHETIC) or local.is_absolute():
        return
    missing = not glob.glob(spec) if glob.has_magic(spec) else not local.exists() and looks_like_path(spec)
    if missing:
        raise UserFileNotFound(f"data.dataset '{spec}' comes from {config_yaml} and is read relative to the current "
                               f"directory ({Path.cwd()}), where it is not; run from the directory the run was started "
                               "in, or pass data.dataset=ABSOLUTE_PATH")


def _run_config_yaml(path: Path) -> Optional[Path]:
    """The config.yaml of the run at `path` (the run's directory, or one of its checkpoints), if it has one."""
    return next((run / "config.yaml" for run in (path, path.parent.parent) if (run / "config.yaml").is_file()), None)


def _is_model(path: Path) -> bool:
    """Whether `path` is something load_model reads (a file, or a directory of a model); its own errors say
    what else is wrong."""
    from ember.model_meta import MODEL_JSON

    return path.is_file() or any((path / name).exists() for name in (MODEL_JSON, "config.json", "checkpoints",
                                                                      "adapter_config.json"))


def _trained_seq_len(path: Path) -> Optional[int]:
    import yaml

    config_yaml = _run_config_yaml(path)
    seq_len = (yaml.safe_load(config_yaml.read_text()) or {}).get("seq_len") if config_yaml else None
    return seq_len if isinstance(seq_len, int) else None
