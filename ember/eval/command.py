"""`ember eval`: the command-line side of ember.eval (argument parsing, the eval.json report).

    ember eval PATH TASK[=DATA] ... [key=value ...] [--output FILE] [--tokenizer FILE]
    ember eval PATH --harness TASK[,TASK] [--include-path DIR] [--limit N] [mesh keys]
    ember eval --nproc-per-node N PATH ... ici_mesh.fsdp=N | ici_mesh.tensor=N ...   (or under torchrun)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from ember.errors import ConfigError, UserFileNotFound

EVAL_USAGE = """usage: ember eval PATH TASK[=DATA] ... [key=value ...] [--output FILE] [--tokenizer FILE]
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

# ppl's keys, and the key that counts rows of the other tasks: each must apply to a task of the command
PPL_KEYS = ("eval.seq_len", "eval.stride", "eval.max_tokens", "eval.split")
EVAL_KEYS = ("eval.limit", "eval.batch_size", *PPL_KEYS)


def run_eval(argv: list[str]) -> int:
    """`ember eval` without its help text and error printing (the CLI's): returns the exit code, raises
    EmberError for a user's mistake."""
    argv, meshes = _split_mesh_keys(argv)
    if "--harness" in argv:
        return _eval_harness(argv, meshes)
    path, tasks, options, data_overrides, output, tokenizer_spec = _parse_eval_args(argv)
    from ember.eval import TASKS, ppl
    from ember.eval.tasks import HUB, TASK_ROWS
    from ember.generate import tokenizer_for

    data_cfg = _eval_data_config(path, tasks.get("ppl"), data_overrides) if "ppl" in tasks else None
    for task, data in tasks.items():  # every local row checked before the model loads
        if task != "ppl" and data not in (None, task, HUB.get(task, ("",))[0]):
            TASK_ROWS[task](data)
    target = _target(Path(path), output)
    _read_previous(target, Path(path))  # a file we may not add to stops us before any work
    model, ranks = _load(path, meshes)
    tokenizer = tokenizer_for(path, tokenizer_spec)  # a torch file's error says how to get the run's
    # ppl's default window: the sequence length the run trained at (its config.yaml), else the model's
    options.setdefault("eval.seq_len", _trained_seq_len(Path(path)))
    results: dict[str, dict] = {}
    limit, batch = options.get("eval.limit"), options.get("eval.batch_size", 16)
    for task, data in tasks.items():
        if task == "ppl":
            split = options.get("eval.split", "all" if data else "val")
            metrics = ppl(model, tokenizer, data_cfg, split, options.get("eval.seq_len"), options.get("eval.stride"),
                          options.get("eval.max_tokens"), batch, ranks)
            results["ppl"] = {**metrics, "data": _data_label(data_cfg.dataset), "split": split}
        else:
            metrics = TASKS[task](model, tokenizer, data or task, limit, batch, ranks)
            results[task] = {**metrics, "data": _data_label(data or task, task)}
    if _is_main():
        _report(Path(path), results, target)
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


def check_eval_launch(argv: list[str], world_size: int) -> None:
    """What `ember eval --nproc-per-node` checks before it starts any process: the mesh fits the world."""
    from ember.eval.distributed import eval_mesh_shape

    eval_mesh_shape(_split_mesh_keys(argv)[1], world_size)


def _load(path: str, meshes: dict[str, dict[str, int]]) -> tuple[Any, Any]:
    """The model and this process's EvalRanks: on one process load_model; under torchrun (or with mesh keys)
    sharded over the mesh."""
    import os

    from ember.eval.distributed import EvalRanks, load_sharded
    from ember.load import load_model

    if int(os.environ.get("WORLD_SIZE", 1)) > 1 or any(meshes.values()):
        model, ranks = load_sharded(path, meshes)
        if _is_main():
            print(f"model sharded over {ranks.layout}; requests shared over {ranks.dp_world} data-parallel ranks")
        return model, ranks
    return load_model(path), EvalRanks()


def _is_main() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def _target(path: Path, output: Optional[str]) -> Path:
    return Path(output) if output else _eval_json_path(path)


def _read_previous(target: Path, path: Path) -> dict[str, Any]:
    """What `target` already holds ({model, step, results}; {} when absent), to merge this run's results into.
    eval.json in the model's own place (the checkpoint, the HF directory, FILE.eval.json) is the model's by
    construction, wherever the model was when it was written (a run moved or copied since); any other file must
    be an eval.json of this model and step, else it is refused rather than overwritten."""
    if not target.exists():
        return {}
    try:
        previous = json.loads(target.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{target} exists and is not an eval.json ember can add to ({str(err).splitlines()[0]}); "
                          "move it aside or pass another --output") from None
    if not isinstance(previous, dict) or not isinstance(previous.get("results"), dict):
        raise ConfigError(f"{target} exists and is not an eval.json ({{model, step, results}}); move it aside or "
                          "pass another --output")
    own = _eval_json_path(path.resolve()).resolve()
    if target.resolve() == own:
        return previous
    theirs = Path(str(previous.get("model", "")))
    same = previous.get("step") == _step_of(path) and (
        theirs.exists() and _eval_json_path(theirs.resolve()).resolve() == own)
    if not same:
        raise ConfigError(f"{target} holds results of another model ({previous.get('model')}, step "
                          f"{previous.get('step')}); pass another --output or move it aside")
    return previous


def _report(path: Path, results: dict[str, dict], target: Path) -> None:
    """Merge `results` into eval.json ({model, step, results}) at `target`: each task's entry replaces that
    task's earlier one, the other tasks' stay. Then print this run's table."""
    before = _read_previous(target, path)
    previous = before.get("results", {})
    merged = {**previous, **results}
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")  # replaced whole: a crash mid-write keeps the earlier file
    # the model's absolute path: a later eval from another directory still recognises it
    report = {"model": os.path.abspath(path), "step": _step_of(path), "results": merged}
    if previous and before.get("model") != report["model"]:
        print(f"{target} was written for the model at {before.get('model')}; it is now at {report['model']}")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, target)
    for task, metrics in results.items():
        print(f"{task:<16}" + "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in metrics.items()))
    kept = [task for task in previous if task not in results]
    print(f"wrote {target}" + (f" (kept the earlier {', '.join(kept)})" if kept else ""))


def _eval_harness(argv: list[str], meshes: dict[str, dict[str, int]]) -> int:
    """`ember eval PATH --harness TASK[,TASK] [--include-path DIR] [--limit N] [--output FILE] [--tokenizer F]`:
    lm-evaluation-harness tasks through ember.eval.harness.EmberLM."""
    from ember.usage import ArgumentParser

    parser = ArgumentParser(prog="ember eval PATH --harness", help_hint="ember eval --help")
    parser.add_argument("path")
    parser.add_argument("--harness", required=True, help="comma-separated lm-eval task names")
    parser.add_argument("--include-path", default=None, help="a folder of task YAMLs (local tasks, offline)")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--output", default=None)
    parser.add_argument("--tokenizer", default=None)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return 0 if exit_.code == 0 else 2
    from ember.eval.harness import EmberLM, simple_evaluate
    from ember.eval.scoring import check_batch_size
    from ember.eval.tasks import check_limit
    from ember.generate import tokenizer_for

    check_limit(args.limit, "--limit")
    check_batch_size(args.batch_size, "--batch-size")
    target = _target(Path(args.path), args.output)
    _read_previous(target, Path(args.path))
    model, ranks = _load(args.path, meshes)
    tokenizer = tokenizer_for(args.path, args.tokenizer)
    lm = EmberLM(model, tokenizer, batch_size=args.batch_size, ranks=ranks)
    out = simple_evaluate(lm, args.harness.split(","), include_path=args.include_path, limit=args.limit)
    if not _is_main():  # lm-eval returns the results on the first process only (its convention under torchrun)
        return 0
    if out is None or not out.get("results"):
        raise ConfigError(f"lm-eval ran no task of '{args.harness}' (check the names and --include-path)")
    data = "lm-eval" + (f" --include-path {Path(args.include_path).resolve()}" if args.include_path else "")
    results = {task: {**{key.split(",")[0]: value for key, value in metrics.items()
                         if isinstance(value, (int, float)) and not isinstance(value, bool)}, "data": data}
               for task, metrics in out["results"].items()}
    _report(Path(args.path), results, target)
    return 0


def _parse_eval_args(argv: list[str]) -> tuple[str, dict[str, Optional[str]], dict, list[str], Optional[str],
                                                Optional[str]]:
    """(path, {task: data or None}, {eval key: value}, data.* overrides, --output, --tokenizer), every value
    checked: each task once, each key applying to a task of the command, numbers >= 1."""
    from ember.eval import TASKS
    from ember.eval.tasks import PPL_SPLITS

    path, rest = argv[0], argv[1:]
    tasks: dict[str, Optional[str]] = {}
    options: dict = {}
    data_overrides: list[str] = []
    output = tokenizer = None
    while rest:
        item = rest.pop(0)
        if item in ("--output", "--tokenizer"):
            if not rest:
                raise ConfigError(f"{item} needs a value")
            output, tokenizer = (rest.pop(0), tokenizer) if item == "--output" else (output, rest.pop(0))
            continue
        name, eq, value = item.partition("=")
        if name in ("ppl", *TASKS):
            if eq and not value:
                raise ConfigError(f"'{item}' names no data; give {name}=FILE" + ("" if name == "choice" else
                                                                                   f" or {name} alone"))
            if name in tasks:  # eval.json keeps one entry per task
                raise ConfigError(f"{name} is given twice ({tasks[name] or name}, {value or name}); eval.json holds "
                                  f"one {name} entry: run one `ember eval` per data, each with its own --output FILE")
            tasks[name] = value or None
        elif name in EVAL_KEYS:
            options[name] = _eval_key(name, value, PPL_SPLITS)
        elif name.startswith("data.") and eq:
            data_overrides.append(item)
        else:
            raise ConfigError(f"unknown eval task or key '{item}' (tasks: ppl, {', '.join(TASKS)}; keys: "
                              f"{', '.join(EVAL_KEYS)}, data.*)")
    if not tasks:
        raise ConfigError("name at least one task: ppl, ppl=DATA, lambada=FILE, boolq=FILE or choice=FILE")
    if "ppl" not in tasks:
        unused = [k for k in options if k in PPL_KEYS] + [o.partition("=")[0] for o in data_overrides]
        if unused:
            raise ConfigError(f"{unused[0]} is a key of ppl, and no ppl task is given")
    if set(tasks) == {"ppl"} and "eval.limit" in options:
        raise ConfigError("eval.limit counts rows of lambada, boolq and choice; ppl is bounded by eval.max_tokens")
    if tasks.get("ppl") and any(o.startswith("data.dataset=") for o in data_overrides):
        raise ConfigError("ppl=DATA and data.dataset both name ppl's data; give one")
    return path, tasks, options, data_overrides, output, tokenizer


def _eval_key(name: str, value: str, splits: tuple[str, ...]) -> Any:
    """An eval.* value, checked: eval.split one of `splits`, the others integers >= 1."""
    if name == "eval.split":
        if value not in splits:
            raise ConfigError(f"eval.split must be one of {', '.join(splits)}, got '{value}'")
        return value
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"{name} must be an integer >= 1, got '{value}'") from None
    if number < 1:
        hint = " (leave it unset to score every row)" if name == "eval.limit" else ""
        raise ConfigError(f"{name} must be an integer >= 1{hint}, got {number}")
    return number


def _eval_data_config(path: str, dataset: Optional[str], overrides: list[str]) -> Any:
    """The data section ppl reads: the run's own (its config.yaml), with data.* overrides and `dataset` (ppl=DATA)."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from ember.config import DataConfig

    base = OmegaConf.structured(DataConfig)
    run = Path(path)
    run = run if (run / "config.yaml").is_file() else run.parent.parent
    dotlist = [o[len("data."):] for o in overrides] + ([f"dataset={dataset}"] if dataset else [])
    try:
        if (run / "config.yaml").is_file():
            base = OmegaConf.merge(base, (yaml.safe_load((run / "config.yaml").read_text()) or {}).get("data", {}))
        base = OmegaConf.merge(base, OmegaConf.from_dotlist(dotlist))
        data_cfg = OmegaConf.to_object(base)
    except OmegaConfBaseException as err:
        raise ConfigError(f"bad data key for ppl: {str(err).splitlines()[0]}") from None
    if not dataset and not any(o.startswith("data.dataset=") for o in overrides) and (run / "config.yaml").is_file():
        _check_run_dataset(data_cfg.dataset, run / "config.yaml")
    return data_cfg


def _check_run_dataset(spec: str, config_yaml: Path) -> None:
    """The run's data.dataset as training wrote it (as given), so a relative path is read relative to the current
    directory: where it is not there, say where it came from and how to point at it."""
    import glob

    from ember.data.sources import EMBEDDED, SYNTHETIC, _looks_like_path

    local = Path(spec).expanduser()
    if spec in (EMBEDDED, SYNTHETIC) or local.is_absolute():
        return
    missing = not glob.glob(spec) if glob.has_magic(spec) else not local.exists() and _looks_like_path(spec)
    if missing:
        raise UserFileNotFound(f"data.dataset '{spec}' comes from {config_yaml} and is read relative to the current "
                               f"directory ({Path.cwd()}), where it is not; run from the directory the run was started "
                               "in, or pass data.dataset=ABSOLUTE_PATH")


def _trained_seq_len(path: Path) -> Optional[int]:
    import yaml

    run = path if (path / "config.yaml").is_file() else path.parent.parent
    if not (run / "config.yaml").is_file():
        return None
    seq_len = (yaml.safe_load((run / "config.yaml").read_text()) or {}).get("seq_len")
    return seq_len if isinstance(seq_len, int) else None


def _step_of(path: Path) -> Optional[int]:
    from ember.model_meta import MODEL_JSON

    if path.is_dir() and (path / "checkpoints").is_dir():
        steps = sorted(int(p.parent.name[5:]) for p in path.glob(f"checkpoints/step-*/{MODEL_JSON}"))
        return steps[-1] if steps else None
    return int(path.name[5:]) if path.name.startswith("step-") and path.name[5:].isdigit() else None


def _eval_json_path(path: Path) -> Path:
    """eval.json beside the model: in the checkpoint (a run's newest), the HF directory, or FILE.eval.json."""
    if path.is_file():
        return path.with_name(path.name + ".eval.json")
    step = _step_of(path)
    if step is not None and (path / "checkpoints").is_dir():
        return path / "checkpoints" / f"step-{step}" / "eval.json"
    return path / "eval.json"
