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
    ember data gym NAME OUT.jsonl [--size N --seed S]       rows of a reasoning-gym generator (SFT, GRPO, eval)
    ember eval PATH TASK[=DATA] ... [key=value ...]   ppl, lambada, boolq, choice (see `ember eval --help`)
    ember generate PATH --prompt TEXT [--max-new-tokens N --temperature T --top-k K --top-p P --stop S --json]
                                             continue prompts with a trained model (KV-cache decoding)
    ember launch local|slurm|k8s RECIPE [key=value ...] --nodes N --nproc-per-node G ...
                                             the same job on this machine, a SLURM cluster (sbatch script, requeue
                                             on preemption) or Kubernetes (a PyTorchJob manifest); see --help
    ember launch xpk|tpu-vm RECIPE [key=value ...] --tpu-type T ...
                                             the same job on Cloud TPUs, by XPK (a GKE cluster) or on every worker
                                             of a TPU VM (device=tpu); see docs/tpu-launch.md
    ember report RUN [RUN ...] [--output FILE.html] [--png DIR]
                                             an HTML page and PNGs of a run's curves, or of runs compared
    ember plan RECIPE [key=value ...] --world N [--nodes M] [--device h100|h200|b200|mi300x|tpu-v5p|...] \
[--search] [--json]
                                             per-rank memory, step time, MFU and a fits/does-not-fit verdict of a
                                             job, computed on this CPU before booking the cluster

User errors (a bad key, value, path or combination) print one line on stderr and exit with 2; usage on stderr
with 2 as well, --help on stdout with 0 (every command and subcommand). `ember --version`: `ember VERSION`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from ember.commands import COMMANDS, run_command
from ember.usage import EXIT_USAGE, ArgumentParser


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
    parser.add_argument("command", choices=COMMANDS, help="what to do (ember/commands/COMMAND.py)")
    parser.add_argument("--version", action="store_true", help="print `ember VERSION` and exit")
    if not argv or argv[0] in ("-h", "--help"):  # help on stdout; without arguments, a usage error on stderr
        parser.print_help(sys.stdout if argv else sys.stderr)
        return 0 if argv else EXIT_USAGE
    if argv[0] in ("--version", "-V"):
        print(f"ember {_version()}")
        return 0
    if argv[0].startswith("-"):  # an option `ember` itself does not have, said as argparse says it
        print(f"error: unrecognized arguments: {argv[0]} (see ember --help)", file=sys.stderr)
        return EXIT_USAGE
    if argv[0] not in COMMANDS:
        print(f"error: unknown command '{argv[0]}' (choose from {', '.join(COMMANDS)})", file=sys.stderr)
        return EXIT_USAGE
    try:
        return run_command(argv[0], argv[1:])
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (which saves first): nothing to save yet
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
