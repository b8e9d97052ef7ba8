"""ember's commands, one module each (ember/commands/NAME.py), every one of the same shape:

    parse(argv) -> argparse.Namespace    the arguments: `--help` prints on stdout and exits 0, a usage mistake
                                         is one line on stderr (ember.usage.ArgumentParser) and exits 2
    run(args) -> int                     the work, over the feature's library code; the exit code

`run_command` runs one with ember's one error handling: a user's mistake (EmberError: a bad key, value, path
or combination) is `error: <one line>` on stderr with exit code 2 (on a rank of a job, reported as the
launcher of ember/launch/local.py collects it); any other exception is a bug and keeps its traceback.
ember/cli.py dispatches `ember NAME ...` here.
"""

from __future__ import annotations

import os
import sys
from importlib import import_module
from typing import Callable

from ember.errors import EmberError, first_error_line
from ember.launch.local import rank_user_error, report_rank_failure
from ember.usage import EXIT_USAGE

COMMANDS = ("convert", "data", "eval", "generate", "launch", "plan", "recipes", "report", "train")


def wants_help(argv: list[str]) -> bool:
    """-h/--help anywhere (`ember train debug --help` too): the hand-parsed commands answer as argparse does."""
    return any(arg in ("-h", "--help") for arg in argv)


def world_size() -> int:
    """The number of processes of the job this one belongs to (torchrun's WORLD_SIZE; 1 alone)."""
    return int(os.environ.get("WORLD_SIZE", 1))


def user_error(message: str) -> int:
    """`error: MESSAGE` on stderr and the exit code 2; on a rank of a job, handed to the launcher instead."""
    if world_size() > 1:
        return rank_user_error(message)
    print(f"error: {message}", file=sys.stderr)
    return EXIT_USAGE


def run_command(name: str, argv: list[str]) -> int:
    """`ember NAME ARGV...`: ember/commands/NAME.py's parse, then its run, a user error as one line.
    SystemExit is argparse's answer (help printed: 0; usage error printed: 2), caught around parse only so that
    one raised by the work keeps its code."""
    command = import_module(f"ember.commands.{name}")  # on demand: `ember --help` loads no command's imports
    try:
        args = command.parse(argv)
    except SystemExit as exit_:
        return 0 if exit_.code in (0, None) else EXIT_USAGE
    except EmberError as err:
        return user_error(first_error_line(err))
    try:
        return command.run(args)
    except EmberError as err:
        return user_error(first_error_line(err))


def as_rank(body: Callable[[], int]) -> int:
    """Run a command's work on one rank of a job (or alone): a user mistake found on the way (data read lazily, a
    checkpoint that cannot be written) is one line, once for all ranks under the launcher, said before the
    process group closes; another exception keeps its traceback, named by rank in a job. The process group is
    closed either way."""
    try:
        return body()
    except EmberError as err:
        return user_error(first_error_line(err))
    except Exception as err:
        if world_size() == 1:
            raise
        return report_rank_failure(err)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
