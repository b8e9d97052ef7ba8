"""`ember train [--nproc-per-node N ...] [RECIPE] [key=value ...]`: train, in this process (or on this rank of a
torchrun job), or as N processes per node through the launcher of ember/launch/local.py."""

from __future__ import annotations

import argparse
import os
import sys

from ember.commands import as_rank, wants_help, world_size
from ember.errors import ConfigError
from ember.launch.local import STOP_EXIT_ENV, launch_local, split_launch_flags

USAGE = """usage: ember train [--nproc-per-node N [--nnodes M --node-rank R --rdzv-endpoint HOST:PORT]] \
[--replica-groups R [--max-restarts K]] [RECIPE] [key=value ...]
  RECIPE: a built-in recipe (see `ember recipes`) or a YAML path; default debug
  --nproc-per-node etc.: start N processes per node through torch.distributed.run (torchrun), which
  is the same as `torchrun --nproc-per-node N -m ember train ...`
  --replica-groups R: a fault-tolerant job on this machine: torchft's lighthouse and R groups of N processes,
  each restarted up to K times (default 3) and healed from a live peer (docs/clusters.md, fault_tolerance.*)"""


def parse(argv: list[str], command: str = "train") -> argparse.Namespace:
    """(launch flags, recipe, overrides). `command`: how the user called it (`launch local` too), for the help
    and the errors."""
    if wants_help(argv):
        print(USAGE.replace("usage: ember train", f"usage: ember {command}", 1))
        raise SystemExit(0)
    flags, rest = split_launch_flags(argv, command)
    recipe, overrides = "debug", list(rest)
    if overrides and "=" not in overrides[0]:
        recipe = overrides.pop(0)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"expected key=value after the recipe, got '{item}' "
                              "(e.g. ember train debug max_steps=50)")
    return argparse.Namespace(flags=flags, argv=rest, recipe=recipe, overrides=overrides)


def run(args: argparse.Namespace) -> int:
    from ember.train import run as run_lib

    if args.flags:
        # (with --replica-groups the launcher checks the overrides it adds: fault_tolerance.*)
        return launch_local(args.flags, "train", args.argv,
                            lambda world, overrides=None: run_lib.load_config(
                                args.recipe, args.overrides if overrides is None else overrides, world_size=world))
    # None: this machine's world (with device=tpu|xla, jax's devices); under torchrun, the job's
    cfg = run_lib.load_config(args.recipe, args.overrides,
                              world_size=world_size() if "WORLD_SIZE" in os.environ else None)
    # imported after validation so config errors come back at once
    from ember.train.trainer import Trainer, TrainingStopped

    trainer = Trainer(cfg)  # on the engine cfg.device trains on (ember/train/engines.py)

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

    return as_rank(train)
