"""`ember eval PATH TASK[=DATA] ... | --harness TASK[,TASK]`: score a model on ember's tasks or lm-eval's and merge the
results into eval.json. The arguments and keys are ember/eval/options.py's (the config's override path); this is
the command: parse, load the model, score, write."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ember.commands import as_rank, wants_help, world_size
from ember.errors import ConfigError
from ember.launch.local import TORCHRUN_FLAGS, launch_local, split_launch_flags
from ember.storage.location import as_path

USAGE = """usage: ember eval PATH TASK[=DATA] ... [key=value ...] [--output FILE] [--tokenizer FILE]
  PATH: an ember run or checkpoint, an HF directory or an `ember convert --to torch` file; local or a URL
        (s3://..., any fsspec URL: the model read through a local cache, a run's newest committed checkpoint)
  tasks: ppl (the run's data source, its validation split), ppl=DATA (all of DATA: a file, folder, glob or
         any data.dataset value), lambada=FILE.jsonl ({"text"}), boolq=FILE.jsonl ({"passage", "question",
         "answer": true/false}), choice=FILE.jsonl ({"context", "choices", "label"}, scored as context + " " +
         choice: no space of a choice's own); `lambada` / `boolq` alone: the hub dataset; gen=FILE (.jsonl, .json
         or .parquet rows of {"prompt" or "messages", "answer"}) or gen=reasoning_gym:NAME: greedy completions
         scored by rewards, each reward's mean its metric. Each task once per command.
  keys: eval.limit=N (the first N rows of each task, N >= 1; unset: all), eval.batch_size=N, eval.seq_len=N and
        eval.stride=N (ppl's window), eval.max_tokens=N (ppl), eval.split=val|train|all (ppl; default: val
        for the run's data, all for ppl=DATA), data.* (ppl's data source; gen reads data.chat_template)
  gen keys: gen.rewards=[exact,math,format,module:function] (default exact), gen.reward_weights=[..],
        gen.format_pattern=REGEX, gen.max_new_tokens=N (256, or a GRPO run's), gen.stop=[TEXT,..],
        gen.prompt_field=NAME, gen.completions=FILE.jsonl (every prompt, completion and reward),
        gen.reward_errors=fail|zero, gen.reward_timeout_s=S, gen.gym_size=N and gen.seed=N (reasoning_gym rows)
  writes eval.json next to the checkpoint, on the store for a URL (--output FILE or URL elsewhere): {"model",
  "step", "results": {task: {metric: value, "data": what was scored}}}; a task run again replaces its own entry,
  the others stay
       ember eval PATH --harness TASK[,TASK] [--include-path DIR] [--limit N]
  lm-evaluation-harness tasks (pip install -e '.[eval]'); offline: local task YAMLs with dataset_path: json and
  absolute data_files, and HF_DATASETS_OFFLINE=1
       ember eval --nproc-per-node N [--nnodes M ...] PATH ... [ici_mesh.AXIS=N dcn_mesh.AXIS=N]
  a model sharded as in training (axes data, fsdp, tensor; default fsdp over every process); requests are
  shared out over the data ranks; the same results as one process. Plain `torchrun ... -m ember eval` works too."""


def parse(argv: list[str]) -> argparse.Namespace:
    """The launcher flags, the mesh keys (`meshes`), and ember.eval.options.parse's arguments, every value checked
    before any work (in the launcher too, before any process starts)."""
    if wants_help(argv):
        print(USAGE)
        raise SystemExit(0)
    from ember.eval import options  # after --help: it loads torch

    flags, rest = split_launch_flags(argv, "eval", options.OPTIONS, TORCHRUN_FLAGS)
    items, meshes = options.split_mesh_keys(rest)
    if not items:  # no model to evaluate: how to call the command, as a usage error (on stderr)
        print(USAGE, file=sys.stderr)
        raise SystemExit(2)
    args = options.parse(items)
    args.flags, args.argv, args.meshes = flags, rest, meshes
    return args


def run(args: argparse.Namespace) -> int:
    if args.flags:
        from ember.eval.distributed import eval_mesh_shape

        # the mesh is checked against the world size here, before any process starts
        return launch_local(args.flags, "eval", args.argv, lambda world: eval_mesh_shape(args.meshes, world))
    return as_rank(lambda: _eval_harness(args) if args.harness else _eval_tasks(args))


def _eval_tasks(args: argparse.Namespace) -> int:
    """The TASK[=DATA] arguments scored, the results merged into eval.json."""
    from ember.eval import TASKS, generative, ppl
    from ember.eval.options import check_task_rows, data_label
    from ember.eval.results import eval_json_target, read_previous, write_results
    from ember.generate import tokenizer_for

    options, data_cfg = args.options, args.data
    check_task_rows(args.tasks)
    gen_rows = generative.read_rows(args.tasks["gen"], args.gen, options.limit) if args.gen else None
    target = eval_json_target(as_path(args.path), args.output)
    read_previous(target, as_path(args.path))  # a file we may not add to stops us before any work
    model, ranks = _load(args.path, args.meshes)
    tokenizer = tokenizer_for(args.path, args.tokenizer)  # a torch file's error says how to get the run's
    gen_prompts = (generative.encode_prompts(gen_rows, tokenizer, data_cfg, args.gen, model.args.max_seq_len)
                   if args.gen else None)  # every prompt fits, before any task runs
    results: dict[str, dict] = {}
    for task, data in args.tasks.items():
        if task == "ppl":
            metrics = ppl(model, tokenizer, data_cfg, options.split, options.seq_len, options.stride,
                          options.max_tokens, options.batch_size, ranks)
            results["ppl"] = {**metrics, "data": data_label(data_cfg.dataset), "split": options.split}
        elif task == "gen":
            scored = generative.evaluate(model, tokenizer, gen_prompts, args.gen, options.batch_size, ranks)
            results["gen"] = {**scored.metrics, "data": generative.data_label(data, args.gen)}
            if args.gen.completions and _is_main():
                generative.write_completions(args.gen.completions, scored.records)
        else:
            metrics = TASKS[task](model, tokenizer, data or task, options.limit, options.batch_size, ranks)
            results[task] = {**metrics, "data": data_label(data or task, task)}
    if _is_main():
        write_results(as_path(args.path), results, target)
    return 0


def _eval_harness(args: argparse.Namespace) -> int:
    """lm-evaluation-harness tasks through ember.eval.harness.EmberLM, the results merged into eval.json."""
    from ember.eval.harness import EmberLM, simple_evaluate, task_manager
    from ember.eval.results import eval_json_target, read_previous, write_results
    from ember.generate import tokenizer_for

    target = eval_json_target(as_path(args.path), args.output)
    read_previous(target, as_path(args.path))
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
    write_results(as_path(args.path), results, target)
    return 0


def _load(path: str, meshes: dict[str, dict[str, int]]) -> tuple[Any, Any]:
    """The model and this process's EvalRanks: on one process load_model; under torchrun (or with mesh keys)
    sharded over the mesh."""
    from ember.eval.distributed import EvalRanks
    from ember.eval.sharded import load_sharded
    from ember.model_io.load import load_model

    if world_size() > 1 or any(meshes.values()):
        model, ranks = load_sharded(path, meshes)
        if _is_main():
            print(f"model sharded over {ranks.layout}; requests shared over {ranks.dp_world} data-parallel ranks")
        return model, ranks
    return load_model(path), EvalRanks()


def _is_main() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0
