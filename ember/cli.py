"""The `ember` command.

    ember train [RECIPE] [key=value ...]     train (RECIPE: a built-in name or a YAML path; default debug)
    ember train --nproc-per-node N [--nnodes M --node-rank R --rdzv-endpoint HOST:PORT] [RECIPE] [key=value ...]
                                             the same, as N processes per node through torch.distributed.run
    ember recipes                            the built-in recipes with their parameter counts
    ember convert SRC DST [--to hf|ember|torch|peft] [--merge] [--overwrite]
                                             between HF safetensors, ember DCP checkpoints and torch.save files;
                                             a LoRA run's adapters as a peft directory, or merged into its base
    ember data prepare SOURCE OUT_DIR        tokenize a source once into memory-mapped shards + manifest
    ember data tokenizer train SOURCE OUT --vocab-size N     train a byte-level BPE tokenizer.json
    ember eval PATH TASK[=DATA] ... [key=value ...]   ppl, lambada, boolq, choice (see `ember eval --help`)
    ember generate PATH --prompt TEXT [--max-new-tokens N --temperature T --top-k K --top-p P --stop S --json]
                                             continue prompts with a trained model (KV-cache decoding)
    ember launch local|slurm|k8s RECIPE [key=value ...] --nodes N --nproc-per-node G ...
                                             the same job on this machine, a SLURM cluster (sbatch script, requeue
                                             on preemption) or Kubernetes (a PyTorchJob manifest); see --help
    ember report RUN [RUN ...] [--output FILE.html] [--png DIR]
                                             an HTML page and PNGs of a run's curves, or of runs compared
    ember plan RECIPE [key=value ...] --world N [--nodes M] [--device h100|h200|b200|mi300x|tpu-v5p|...] [--search] [--json]
                                             per-rank memory, step time, MFU and a fits/does-not-fit verdict of a
                                             job, computed on this CPU before booking the cluster

User errors (a bad key, value, path or combination) print one line on stderr and exit with 2; usage on stderr
with 2 as well, --help on stdout with 0 (every command and subcommand). `ember --version`: `ember VERSION`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable, Optional

from ember.errors import ConfigError, EmberError
from ember.launch.local import ERROR_DIR_ENV, LAUNCH_FLAGS, STOP_EXIT_ENV, launch_local, split_launch_flags
from ember.usage import ArgumentParser

EXIT_USAGE = 2


def _one_line(err: BaseException) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__




def _fail_rank(message: str, world_size: int) -> int:
    """A user error on one rank of a job: handed to `ember train --nproc-per-node`'s launcher, which prints
    each distinct message once with the ranks that hit it; under plain torchrun, printed with the rank."""
    if world_size == 1:
        return _fail(message)
    rank = os.environ.get("RANK", "0")
    if os.environ.get(ERROR_DIR_ENV):
        Path(os.environ[ERROR_DIR_ENV], f"rank{rank}.txt").write_text(message + "\n")
        return EXIT_USAGE
    return _fail(f"[rank {rank}] {message}")


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return EXIT_USAGE


TRAIN_USAGE = """usage: ember train [--nproc-per-node N [--nnodes M --node-rank R --rdzv-endpoint HOST:PORT]] [RECIPE] [key=value ...]
  RECIPE: a built-in recipe (see `ember recipes`) or a YAML path; default debug
  --nproc-per-node etc.: start N processes per node through torch.distributed.run (torchrun), which
  is the same as `torchrun --nproc-per-node N -m ember train ...`"""


def _wants_help(argv: list[str]) -> bool:
    """-h/--help anywhere (`ember train debug --help` too): the hand-parsed commands answer as argparse does."""
    return any(arg in ("-h", "--help") for arg in argv)


def _report_rank_failure(err: BaseException) -> int:
    """Print an exception with the rank it happened on; torchrun then stops the other ranks."""
    import traceback

    rank = os.environ.get("RANK", "0")
    for line in traceback.format_exception(err):
        for part in line.rstrip("\n").split("\n"):
            print(f"[rank {rank}] {part}", file=sys.stderr)
    print(f"error: [rank {rank}] {type(err).__name__}: {err}", file=sys.stderr)
    return 1


def cmd_train(argv: list[str], command: str = "train") -> int:
    from ember import config as config_lib

    if _wants_help(argv):
        print(TRAIN_USAGE)
        return 0
    try:
        flags, argv = split_launch_flags(argv, command)
    except ConfigError as err:
        return _fail(str(err))
    recipe, overrides = "debug", list(argv)
    if overrides and "=" not in overrides[0]:
        recipe = overrides.pop(0)
    for item in overrides:
        if "=" not in item:
            return _fail(f"expected key=value after the recipe, got '{item}' (e.g. ember train debug max_steps=50)")
    if flags:
        try:
            return launch_local(flags, "train", argv, lambda world: config_lib.load(recipe, overrides, world_size=world))
        except ConfigError as err:
            return _fail(str(err))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    try:
        cfg = config_lib.load(recipe, overrides, world_size=world_size)
        from ember.train import Trainer  # imported after validation so config errors come back at once

        trainer = Trainer(cfg)
    except EmberError as err:
        # A mistake in the user's config, data or files: the message names it and the fix, a traceback
        # would only bury it. Any other exception is a bug and keeps its traceback.
        return _fail_rank(_one_line(err), world_size)
    from ember.train import TrainingStopped

    def train() -> int:
        try:
            summary = trainer.train()
        except TrainingStopped as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        # 130: the shell's "interrupted" (128 + SIGINT): saved, but not finished
        if summary["stopped_by_signal"] == "SIGINT":
            return 130
        # Stopped by SIGTERM/SIGUSR1 (preemption): saved, exit 0, unless the scheduler needs a failure to restart
        # the job: `ember launch k8s` sets EMBER_EXIT_CODE_ON_STOP=75 so that every pod of a job one of whose
        # pods was evicted fails, OnFailure restarts them all, and resume=auto continues from the checkpoint.
        stop_code = os.environ.get(STOP_EXIT_ENV, "")
        return int(stop_code) if summary["stopped_by_signal"] and stop_code.isdigit() else 0

    return _as_rank(train, world_size)


def _as_rank(body: Callable[[], int], world_size: int) -> int:
    """Run a command's body on one rank of a job (or alone): a user mistake found on the way (data read lazily, a
    checkpoint that cannot be written) is one line, once for all ranks under the launcher; another exception
    keeps its traceback, named by rank. The process group is closed either way."""
    try:
        return body()
    except EmberError as err:
        return _fail_rank(_one_line(err), world_size)
    except Exception as err:
        if world_size == 1:
            raise
        return _report_rank_failure(err)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def cmd_recipes(argv: list[str]) -> int:
    if _wants_help(argv):
        print("usage: ember recipes\n  the built-in recipes with their parameter counts (total and active), "
              "sequence length and batch")
        return 0
    if argv:
        return _fail(f"`ember recipes` takes no arguments, got {' '.join(argv)}")
    import torch
    from rich.console import Console
    from rich.table import Table

    from ember import config as config_lib
    from ember.models import MODELS, build_model_args

    table = Table(title="ember recipes")
    for column in ("recipe", "family", "flavor", "parameters", "active", "seq_len", "global batch", "tokens/step"):
        table.add_column(column, justify="left" if column in ("recipe", "family", "flavor") else "right", no_wrap=True)
    for name in config_lib.recipe_names():
        cfg = config_lib.load(name)
        spec = MODELS[cfg.model.family]
        args = build_model_args(cfg.model.family, cfg.model.flavor, config_lib.model_overrides(cfg.model))
        with torch.device("meta"):  # shapes only: 405B costs no memory here
            model = spec.model_cls(args)
            n_params = sum(p.numel() for p in model.parameters())
            # Active: what one token passes through, as the family counts it (a mixture of experts uses
            # top_k of its n_experts, in the layers that have experts); a dense family uses every parameter.
            n_active = spec.active_params(model) if spec.active_params is not None else n_params
        table.add_row(
            name,
            cfg.model.family,
            cfg.model.flavor,
            f"{n_params:,}",
            f"{n_active:,}",
            str(cfg.seq_len),
            str(cfg.global_batch_size),
            f"{cfg.seq_len * cfg.global_batch_size:,}",
        )
    console = Console()
    console.width = max(console.width, 130)  # pipes report 80 columns; never truncate the numbers
    console.print(table)
    return 0


def cmd_data(argv: list[str]) -> int:
    from ember.data.command import run_data

    try:
        return run_data(argv)
    except SystemExit as exit_:  # argparse: --help (0) or a usage error (2, its message already printed)
        return 0 if exit_.code == 0 else EXIT_USAGE
    except EmberError as err:
        return _fail(_one_line(err))


def cmd_convert(argv: list[str]) -> int:
    parser = ArgumentParser(prog="ember convert", description="Convert a model between formats: a Hugging "
                                     "Face directory (hf), an ember DCP checkpoint (ember), a torch.save file (torch).")
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--to", choices=("hf", "ember", "torch", "peft"), default=None,
                        help="target format (default: hf -> ember, ember -> hf, torch -> ember); peft: a LoRA run's "
                        "adapters as adapter_config.json + adapter_model.safetensors")
    parser.add_argument("--merge", action="store_true", help="fold a LoRA run's (or a peft adapter's) adapters into "
                        "its base (W + alpha/r B A) and write a whole model (hf unless --to says otherwise; implied "
                        "for hf, ember, torch); refused for a whole model, which has none")
    parser.add_argument("--overwrite", action="store_true", help="replace what DST holds (refused without it when "
                        "DST is not empty, and always when DST holds what the conversion reads; a file only when it "
                        "is an earlier --to torch export). --to torch writes a file, the others a directory")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return 0 if exit_.code == 0 else EXIT_USAGE
    from ember.convert import convert

    try:
        target = convert(args.src, args.dst, args.to, merge=args.merge, overwrite=args.overwrite)
    except EmberError as err:
        return _fail(_one_line(err))
    print(f"wrote {args.dst} ({target})")
    return 0


def cmd_generate(argv: list[str]) -> int:
    parser = ArgumentParser(
        prog="ember generate", description="Continue prompts with a trained model (KV-cache decoding). PATH: an ember "
        "run or checkpoint, an HF directory or an `ember convert --to torch` file.")
    parser.add_argument("path")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    parser.add_argument("--prompt-file", help="a jsonl of {\"prompt\": ...} rows, decoded as one batch")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=None,
                        help="finite, >= 0; 0: greedy. Default: greedy, or 1.0 when --top-k, --top-p or --seed is "
                        "given (these sample; with --temperature 0 they are an error)")
    parser.add_argument("--top-k", type=int, default=None, help=">= 1: sample from the K most likely tokens")
    parser.add_argument("--top-p", type=float, default=None, help="in (0, 1]: sample from the smallest set of tokens "
                        "holding this probability mass")
    parser.add_argument("--seed", type=int, default=None, help="seed the sampling (same seed, same output)")
    parser.add_argument("--stop", action="append", default=[], help="stop at this string, not empty (repeatable)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer file (default: the run's own)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt: prompt, completion, token_ids")
    parser.add_argument("--compile", action="store_true", help="torch.compile the decode step (for long outputs)")
    try:
        args = parser.parse_args(argv)
        if not args.prompt and not args.prompt_file:  # a usage error: the usage, then the line, on stderr
            parser.usage_error("give --prompt TEXT or --prompt-file FILE.jsonl")
    except SystemExit as exit_:
        return 0 if exit_.code == 0 else EXIT_USAGE
    import json

    import torch

    from ember.generate import check_max_new_tokens, generate, prompt_ids, sampling_temperature, tokenizer_for
    from ember.hardware import pick_device
    from ember.load import load_model

    # Every argument is checked before anything is printed: a streamed prompt followed by an error would run
    # the two together on one line.
    try:
        temperature = sampling_temperature(args.temperature, args.top_k, args.top_p, args.seed, args.stop)
        check_max_new_tokens(args.max_new_tokens)
        prompts = list(args.prompt)
        if args.prompt_file:
            prompts += _read_prompts(Path(args.prompt_file))
        device = pick_device(args.device)
        dtype = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
        model = load_model(args.path, device=device, dtype=dtype)
        tokenizer = tokenizer_for(args.path, args.tokenizer)
        prompt_ids(model, tokenizer, prompts, args.max_new_tokens)  # each prompt fits max_seq_len with the new tokens
        if args.temperature is None and temperature > 0:
            print(f"note: sampling at temperature {temperature} (--top-k/--top-p/--seed sample; --temperature sets it)",
                  file=sys.stderr)
        stream = not args.json and len(prompts) == 1
        if stream:
            print(prompts[0], end="", flush=True)
        results = generate(model, tokenizer, prompts, max_new_tokens=args.max_new_tokens,
                           temperature=temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                           stop=args.stop, compile=args.compile,
                           on_text=(lambda row, piece: print(piece, end="", flush=True)) if stream else None)
    except EmberError as err:
        return _fail(_one_line(err))
    for result in results:
        if args.json:
            print(json.dumps({"prompt": result.prompt, "completion": result.completion, "token_ids": result.token_ids}))
        elif stream:
            print()
        else:
            print(f"{result.prompt}{result.completion}\n")
    return 0


def _read_prompts(path: Path) -> list[str]:
    """The "prompt" of every row of a jsonl file; errors name the file and line."""
    from ember.errors import DataError
    from ember.eval.tasks import read_rows

    prompts = [row["prompt"] for row in read_rows(str(path), "--prompt-file", ("prompt",))]
    if not all(isinstance(p, str) for p in prompts):
        raise DataError(f"--prompt-file '{path}': every \"prompt\" must be text")
    return prompts


def cmd_eval(argv: list[str]) -> int:
    from ember.eval.command import EVAL_USAGE, run_eval

    if not argv or _wants_help(argv):  # help on stdout; without arguments, a usage error on stderr
        print(EVAL_USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else EXIT_USAGE
    from ember.eval.command import check_eval_launch

    try:
        flags, argv = split_launch_flags(argv, "eval")
        if flags:
            return launch_local(flags, "eval", argv, lambda world: check_eval_launch(argv, world))
    except EmberError as err:
        return _fail(_one_line(err))
    return _as_rank(lambda: run_eval(argv), int(os.environ.get("WORLD_SIZE", 1)))


def cmd_report(argv: list[str]) -> int:
    parser = ArgumentParser(
        prog="ember report", description="An HTML page (self-contained: open it anywhere) and PNGs of a run's curves "
        "and summary; of several runs, the curves overlaid and the config keys that differ. A run still training, "
        "or killed and resumed, is read as it is (the last record of each step).")
    parser.add_argument("runs", nargs="+", metavar="RUN", help="an `ember train` output_dir")
    parser.add_argument("--output", metavar="FILE.html", default=None,
                        help="the page (default: RUN/report.html for one run, ./report.html for several)")
    parser.add_argument("--png", metavar="DIR", default=None,
                        help="where the figures go as PNGs (default: the page's path without .html, e.g. RUN/report/)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return 0 if exit_.code == 0 else EXIT_USAGE
    from ember.report import build_report

    try:
        report = build_report(args.runs, args.output, args.png)
    except EmberError as err:
        return _fail(_one_line(err))
    for note in report.missing + [f"{run.name}: {note}" for run in report.runs for note in run.notes]:
        print(f"note: {note}")
    count = len(report.plots)
    print(f"wrote {report.html} and {count} figure{'' if count == 1 else 's'} in {report.png_dir}/")
    return 0


def cmd_plan(argv: list[str]) -> int:
    from ember.plan.command import run_plan

    try:
        return run_plan(argv)
    except SystemExit as exit_:  # argparse: --help (0) or a usage error (2, its message already printed)
        return 0 if exit_.code == 0 else EXIT_USAGE
    except EmberError as err:
        return _fail(_one_line(err))


def cmd_launch(argv: list[str]) -> int:
    if argv and argv[0] == "local":  # the built-in launcher above, listed with the others so that all look alike
        rest = argv[1:]
        if _wants_help(rest):
            print(TRAIN_USAGE.replace("ember train", "ember launch local"))
            return 0
        if not any(arg.split("=")[0] in LAUNCH_FLAGS for arg in rest):
            rest = ["--nproc-per-node", "1", *rest]
        return cmd_train(rest, "launch local")
    from ember.launch.cli import main as launch_main

    return launch_main(argv)


COMMANDS = {"launch": cmd_launch, "train": cmd_train, "recipes": cmd_recipes, "data": cmd_data, "convert": cmd_convert,
            "generate": cmd_generate, "eval": cmd_eval, "report": cmd_report, "plan": cmd_plan}


def _version() -> str:
    """The installed package's version (pyproject.toml's, through the package metadata)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ember")
    except PackageNotFoundError:
        return "(not installed as a package: pip install -e .)"


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = ArgumentParser(prog="ember", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("command", choices=sorted(COMMANDS), help="what to do")
    parser.add_argument("--version", action="store_true", help="print `ember VERSION` and exit")
    if not argv or argv[0] in ("-h", "--help"):  # help on stdout; without arguments, a usage error on stderr
        parser.print_help(sys.stdout if argv else sys.stderr)
        return 0 if argv else EXIT_USAGE
    if argv[0] in ("--version", "-V"):
        print(f"ember {_version()}")
        return 0
    if argv[0] not in COMMANDS:
        return _fail(f"unknown command '{argv[0]}' (choose from {', '.join(sorted(COMMANDS))})")
    try:
        return COMMANDS[argv[0]](argv[1:])
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (which saves first): nothing to save yet
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
