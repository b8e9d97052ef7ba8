"""`ember train|eval --nproc-per-node N ...` (and `ember launch local`): the job's config checked for its world
size, then `ember COMMAND` started on every rank through torch.distributed.run (torchrun), with the ranks' user
errors printed once each and a signal to the launcher answered as a single process answers it. The ranks' side
too: a user error handed to the launcher (rank_user_error), another exception printed with its rank."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

from ember.errors import ConfigError
from ember.usage import EXIT_USAGE

STOP_EXIT_ENV = "EMBER_EXIT_CODE_ON_STOP"  # the exit code of a run stopped (and saved) by SIGTERM/SIGUSR1
ERROR_DIR_ENV = "EMBER_ERROR_DIR"  # set by the launcher: where ranks leave their user errors


TORCHRUN_FLAGS = ("--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-endpoint")  # ember eval's
LAUNCH_FLAGS = (*TORCHRUN_FLAGS, "--replica-groups", "--max-restarts")  # ember train's (and launch local's)


def split_launch_flags(argv: list[str], command: str = "train", own_options: tuple[str, ...] = (),
                       launch_flags: tuple[str, ...] = LAUNCH_FLAGS) -> tuple[dict[str, str], list[str]]:
    """Leading launcher flags (`--flag value` or `--flag=value`), and the rest. `own_options`: the command's own
    options; one of them ends the launcher flags (the command reads it), any other option is refused naming
    both."""
    flags: dict[str, str] = {}
    rest = list(argv)
    while rest and rest[0].startswith("--"):
        name = rest[0].partition("=")[0].replace("_", "-")
        if name in own_options:
            break
        if name not in launch_flags:
            raise unknown_option(name, command, (*own_options, *launch_flags))
        _, eq, value = rest.pop(0).partition("=")
        if not eq:
            if not rest:
                raise ConfigError(f"option {name} needs a value")
            value = rest.pop(0)
        flags[name] = value
    return flags, rest


def unknown_option(name: str, command: str, options: Sequence[str]) -> ConfigError:
    """The one line for an option `ember COMMAND` does not have, listing the `options` it has."""
    listed = f"options: {', '.join(options)}" if options else "it takes none"
    return ConfigError(f"unknown option '{name}' for ember {command} ({listed})")


def _positive_int(flags: dict[str, str], name: str, default: int) -> int:
    try:
        value = int(flags.get(name, default))
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got '{flags[name]}'") from None
    if value < 1:
        raise ConfigError(f"{name} must be >= 1, got {value}")
    return value


def launch_local(flags: dict[str, str], command: str, command_argv: list[str], check: Callable[[int], object]) -> int:
    """`check(world_size)` the job's config (it raises ConfigError), then start `ember COMMAND ...` on every
    rank through torch.distributed.run."""
    nproc = _positive_int(flags, "--nproc-per-node", 1)
    nnodes = _positive_int(flags, "--nnodes", 1)
    if {"--replica-groups", "--max-restarts"} & set(flags):
        return _launch_groups(flags, command, command_argv, check, nproc, nnodes)
    if nnodes > 1 and "--rdzv-endpoint" not in flags:
        raise ConfigError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the node of rank 0) and --node-rank")
    node_rank = int(flags.get("--node-rank", 0)) if flags.get("--node-rank", "0").isdigit() else -1
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"--node-rank must be in [0, {nnodes}), got {flags.get('--node-rank')}")
    check(nproc * nnodes)  # fail here, before any process starts
    run_args = ["--nproc-per-node", str(nproc), "--nnodes", str(nnodes)]
    if nnodes > 1:
        run_args += ["--node-rank", str(node_rank), "--rdzv-backend", "c10d",
                     "--rdzv-endpoint", flags["--rdzv-endpoint"], "--rdzv-id", "ember"]
    else:
        run_args += ["--standalone"]
    import tempfile

    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    # torchrun sets one thread per process and says so; ember sets its own share of the cores instead.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # The ranks' own errors are what the user needs; the launcher's "failed (exitcode: ...)" and "Received 2 death
    # signal" records are not. Each elastic module's logger has its own level, so the parent's alone is not enough.
    for name in [name for name in logging.root.manager.loggerDict if name.startswith("torch.distributed.elastic")]:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    killed = _KilledRanks()  # but which ranks torchrun had to kill after a signal is worth a word
    processes_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    processes_log.setLevel(logging.WARNING)
    processes_log.propagate = False
    processes_log.addHandler(killed)
    with tempfile.TemporaryDirectory(prefix="ember-errors-") as error_dir:
        os.environ[ERROR_DIR_ENV] = error_dir  # ranks write user errors there instead of printing each
        try:
            torchrun_main(run_args + ["-m", "ember", command, *command_argv])
        except SignalException as err:
            # torchrun passed the signal on to every rank and waited for them: each said above what it did.
            return _stopped_by(signal_name=err.sigval.name, killed=killed.pids)
        except ChildFailedError as err:
            user_errors: dict[str, list[str]] = {}  # message -> ranks, so an error every rank hit prints once
            for path in sorted(Path(error_dir).glob("rank*.txt"), key=lambda p: int(p.stem[4:])):
                user_errors.setdefault(path.read_text().strip(), []).append(path.stem[4:])
            for message, ranks in user_errors.items():
                print(f"error: [rank {', '.join(ranks)}] {message}", file=sys.stderr)
            if user_errors:
                return EXIT_USAGE
            rank, first = err.get_first_failure()  # the root cause; the launcher stopped the other ranks
            print(f"error: the job failed on rank {rank} (exit code {first.exitcode}); its error is printed above",
                  file=sys.stderr)
            return 1
        finally:
            os.environ.pop(ERROR_DIR_ENV, None)
            processes_log.removeHandler(killed)
            processes_log.propagate = True
    return 0


def _launch_groups(flags: dict[str, str], command: str, command_argv: list[str], check: Callable[[int], object],
                   nproc: int, nnodes: int) -> int:
    """--replica-groups R: a fault-tolerant training job of R torchrun groups (ember/launch/replica_groups.py)."""
    from ember.launch import replica_groups as groups_lib
    from ember.storage.mirror import local_run_dir

    if command != "train" or "--replica-groups" not in flags:
        raise ConfigError(f"--max-restarts and --replica-groups go together, with ember train (not {command})"
                          if command != "train" else "--max-restarts restarts replica groups: give --replica-groups R")
    if nnodes > 1:
        raise ConfigError("--replica-groups runs every group on this machine; on a cluster, run one job per group "
                          "(see docs/clusters.md: replica groups)")
    groups = _positive_int(flags, "--replica-groups", 1)
    restarts = flags.get("--max-restarts", str(groups_lib.DEFAULT_MAX_RESTARTS))
    if not restarts.isdigit():
        raise ConfigError(f"--max-restarts must be an integer >= 0, got '{restarts}'")
    recipe = command_argv[:1] if command_argv and "=" not in command_argv[0] else []
    argv = [*recipe, *groups_lib.group_overrides(command_argv[len(recipe):], groups)]
    cfg = check(nproc, argv[len(recipe):])
    return groups_lib.launch_replica_groups(argv, cfg.output_dir, Path(local_run_dir(cfg.output_dir)), groups, nproc,
                                            int(restarts), cfg.fault_tolerance.min_replica_groups)


def rank_user_error(message: str) -> int:
    """A user error on one rank of a job: left in the launcher's error directory (it prints each distinct message
    once, with the ranks that hit it); under plain torchrun, printed with the rank."""
    rank = os.environ.get("RANK", "0")
    if os.environ.get(ERROR_DIR_ENV):
        Path(os.environ[ERROR_DIR_ENV], f"rank{rank}.txt").write_text(message + "\n")
    else:
        print(f"error: [rank {rank}] {message}", file=sys.stderr)
    return EXIT_USAGE


def report_rank_failure(err: BaseException) -> int:
    """Print an exception (a bug, not a user error) with the rank it happened on; torchrun then stops the other
    ranks."""
    import traceback

    rank = os.environ.get("RANK", "0")
    for line in traceback.format_exception(err):
        for part in line.rstrip("\n").split("\n"):
            print(f"[rank {rank}] {part}", file=sys.stderr)
    print(f"error: [rank {rank}] {type(err).__name__}: {err}", file=sys.stderr)
    return 1


class _KilledRanks(logging.Handler):
    """Notes the ranks torchrun killed because they had not stopped within its shutdown timeout (its record is
    silenced with the others; the one line after a signal says it instead)."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.pids: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("Unable to shutdown process") and record.args:
            self.pids.append(str(record.args[0]))


def _stopped_by(signal_name: str, killed: list[str]) -> int:
    """The launcher's one line and exit code after SIGINT/SIGTERM (it passes the signal on to the ranks): those of
    a single process, 130 for SIGINT, 0 or EMBER_EXIT_CODE_ON_STOP for SIGTERM, 128 + N for another signal."""
    import signal

    if killed:
        print(f"error: stopped by {signal_name}, but torchrun killed process {', '.join(killed)}, not stopped within "
              "its shutdown timeout: a checkpoint being written is not committed (resume=auto uses the one before; "
              "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=SECONDS waits longer than the default 30)", file=sys.stderr)
    else:
        print(f"stopped by {signal_name}: passed on to every rank (a training run saves a checkpoint at its next "
              "step and exits; the ranks' lines above say what each did)", file=sys.stderr)
    stop_code = os.environ.get(STOP_EXIT_ENV, "")
    if signal_name == "SIGTERM":
        return int(stop_code) if stop_code.isdigit() else 0
    return 128 + signal.Signals[signal_name].value
