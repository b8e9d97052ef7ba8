"""`ember eval`: the command-line side of ember.eval (argument parsing, the eval.json report).

    ember eval PATH TASK[=DATA] ... [key=value ...] [--output FILE] [--tokenizer FILE]
    ember eval PATH --harness TASK[,TASK] [--include-path DIR] [--limit N] [mesh keys]
    ember eval --nproc-per-node N PATH ... ici_mesh.fsdp=N | ici_mesh.tensor=N ...   (or under torchrun)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional

from ember.errors import ConfigError

EVAL_USAGE = """usage: ember eval PATH TASK[=DATA] ... [key=value ...] [--output FILE] [--tokenizer FILE]
  PATH: an ember run or checkpoint, an HF directory or an `ember convert --to torch` file
  tasks: ppl (an ember data source: data.dataset=..., data.* keys; the validation split by default),
         lambada=FILE.jsonl ({"text"}), boolq=FILE.jsonl ({"passage", "question", "answer"}),
         choice=FILE.jsonl ({"context", "choices", "label"}); `lambada` / `boolq` alone: the hub dataset
  keys: eval.limit=N (rows per task), eval.batch_size=N, eval.seq_len=N and eval.stride=N (ppl window),
        eval.max_tokens=N (ppl), eval.split=val|train (ppl)
  writes eval.json next to the checkpoint: {"model", "step", "results": {task: {metric: value}}}
       ember eval PATH --harness TASK[,TASK] [--include-path DIR] [--limit N]
  lm-evaluation-harness tasks (pip install -e '.[eval]'); offline: local task YAMLs with dataset_path: json and
  absolute data_files, and HF_DATASETS_OFFLINE=1
       ember eval --nproc-per-node N [--nnodes M ...] PATH ... [ici_mesh.AXIS=N dcn_mesh.AXIS=N]
  a model sharded as in training (axes data, fsdp, tensor; default fsdp over every process); requests are
  shared out over the data ranks; the same results as one process. Plain `torchrun ... -m ember eval` works too."""

EVAL_KEYS = {"eval.limit": int, "eval.batch_size": int, "eval.seq_len": int, "eval.stride": int,
             "eval.max_tokens": int, "eval.split": str}


def run_eval(argv: list[str]) -> int:
    """`ember eval` without its help text and error printing (the CLI's): returns the exit code, raises
    EmberError for a user's mistake."""
    argv, meshes = _split_mesh_keys(argv)
    if "--harness" in argv:
        return _eval_harness(argv, meshes)
    path, tasks, options, data_overrides, output, tokenizer_spec = _parse_eval_args(argv)
    from ember.eval import TASKS, ppl
    from ember.generate import tokenizer_for

    model, ranks = _load(path, meshes)
    tokenizer = tokenizer_for(path, tokenizer_spec)
    # ppl's default window: the sequence length the run trained at (its config.yaml), else the model's
    options.setdefault("eval.seq_len", _trained_seq_len(Path(path)))
    results: dict[str, dict] = {}
    limit, batch = options.get("eval.limit"), options.get("eval.batch_size", 16)
    for task, data in tasks:
        if task == "ppl":
            results["ppl"] = ppl(model, tokenizer, _eval_data_config(path, data_overrides),
                                 options.get("eval.split", "val"), options.get("eval.seq_len"),
                                 options.get("eval.stride"), options.get("eval.max_tokens"), batch, ranks)
        else:
            results[task] = TASKS[task](model, tokenizer, data or task, limit, batch, ranks)
    if _is_main():
        _report(Path(path), results, output)
    return 0


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


def _report(path: Path, results: dict[str, dict], output: Optional[str]) -> None:
    """Write eval.json ({model, step, results}) beside the model or at `output`, and print the table."""
    target = Path(output) if output else _eval_json_path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps({"model": str(path), "step": _step_of(path), "results": results}, indent=2) + "\n")
    for task, metrics in results.items():
        print(f"{task:<16}" + "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in metrics.items()))
    print(f"wrote {target}")


def _eval_harness(argv: list[str], meshes: dict[str, dict[str, int]]) -> int:
    """`ember eval PATH --harness TASK[,TASK] [--include-path DIR] [--limit N] [--output FILE] [--tokenizer F]`:
    lm-evaluation-harness tasks through ember.eval.harness.EmberLM."""
    parser = argparse.ArgumentParser(prog="ember eval PATH --harness")
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
    from ember.generate import tokenizer_for

    model, ranks = _load(args.path, meshes)
    tokenizer = tokenizer_for(args.path, args.tokenizer)
    lm = EmberLM(model, tokenizer, batch_size=args.batch_size, ranks=ranks)
    out = simple_evaluate(lm, args.harness.split(","), include_path=args.include_path, limit=args.limit)
    if not _is_main():  # lm-eval returns the results on the first process only (its convention under torchrun)
        return 0
    if out is None or not out.get("results"):
        raise ConfigError(f"lm-eval ran no task of '{args.harness}' (check the names and --include-path)")
    results = {task: {key.split(",")[0]: value for key, value in metrics.items()
                      if isinstance(value, (int, float)) and not isinstance(value, bool)}
               for task, metrics in out["results"].items()}
    if _is_main():
        _report(Path(args.path), results, args.output)
    return 0


def _parse_eval_args(argv: list[str]) -> tuple[str, list[tuple[str, Optional[str]]], dict, list[str], Optional[str],
                                                Optional[str]]:
    from ember.eval import TASKS

    path, rest = argv[0], argv[1:]
    tasks: list[tuple[str, Optional[str]]] = []
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
            tasks.append((name, value or None))
        elif name in EVAL_KEYS:
            try:
                options[name] = EVAL_KEYS[name](value)
            except ValueError:
                raise ConfigError(f"{name} must be {EVAL_KEYS[name].__name__}, got '{value}'") from None
        elif name.startswith("data.") and eq:
            data_overrides.append(item)
        else:
            raise ConfigError(f"unknown eval task or key '{item}' (tasks: ppl, {', '.join(TASKS)}; keys: "
                              f"{', '.join(EVAL_KEYS)}, data.*)")
    if not tasks:
        raise ConfigError("name at least one task: ppl, lambada=FILE, boolq=FILE or choice=FILE")
    return path, tasks, options, data_overrides, output, tokenizer


def _eval_data_config(path: str, overrides: list[str]) -> Any:
    """The data section ppl reads: the run's own (its config.yaml), with data.* overrides."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from ember.config import DataConfig

    base = OmegaConf.structured(DataConfig)
    run = Path(path)
    run = run if (run / "config.yaml").is_file() else run.parent.parent
    try:
        if (run / "config.yaml").is_file():
            base = OmegaConf.merge(base, (yaml.safe_load((run / "config.yaml").read_text()) or {}).get("data", {}))
        base = OmegaConf.merge(base, OmegaConf.from_dotlist([o[len("data."):] for o in overrides]))
        return OmegaConf.to_object(base)
    except OmegaConfBaseException as err:
        raise ConfigError(f"bad data key for ppl: {str(err).splitlines()[0]}") from None


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
