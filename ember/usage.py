"""The argument parser of every `ember` command: a usage mistake is one line on stderr, as any other user error.

argparse's own error() prints the whole usage block before its message; ember's commands print
`error: MESSAGE (see ember COMMAND --help)` and exit 2 instead. A command called without what it needs (no
arguments at all, or usage_error) still prints its usage, how to call it, with the message on stderr, and
`--help` prints everything on stdout with 0. An option the command does not have is named, even where
argparse would first complain of a missing argument (`ember plan --no-such-flag`).
Subcommands (add_subparsers) are built with the same class, so they behave the same.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn, Optional, Sequence

EXIT_USAGE = 2  # the exit code of a usage mistake and of every other user error (ember.errors.EmberError)


class ArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose usage errors are one line. `help_hint`: the command whose --help the line
    points to (default: the parser's prog, e.g. `ember launch slurm`)."""

    def __init__(self, *args: Any, help_hint: Optional[str] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.help_hint = help_hint or f"{self.prog} --help"
        self._bare = False  # parsed with no arguments at all: the usage says how to call the command
        self._given: list[str] = []  # the arguments being parsed

    def parse_known_args(self, args: Optional[Sequence[str]] = None,
                         namespace: Optional[argparse.Namespace] = None) -> tuple[argparse.Namespace, list[str]]:
        self._given = list(sys.argv[1:] if args is None else args)
        self._bare = args is not None and len(args) == 0
        return super().parse_known_args(args, namespace)

    def _unknown_options(self) -> list[str]:
        """The given options (before a `--`) that are none of this parser's, nor an abbreviation of one."""
        unknown = []
        for arg in self._given:
            if arg == "--":
                break
            name = arg.partition("=")[0]
            if not arg.startswith("-") or arg == "-" or self._negative_number_matcher.match(arg):
                continue
            options = self._option_string_actions
            known = name in options or (self.allow_abbrev and name.startswith("--")
                                        and any(option.startswith(name) for option in options))
            if not known:
                unknown.append(arg)
        return unknown

    def error(self, message: str) -> NoReturn:
        unknown = self._unknown_options()
        if unknown and message.startswith("the following arguments are required"):
            message = f"unrecognized arguments: {' '.join(unknown)}"  # the cause, rather than its consequence
        if self._bare:
            self.usage_error(message)
        self.exit(EXIT_USAGE, f"error: {message} (see {self.help_hint})\n")

    def usage_error(self, message: str) -> NoReturn:
        """A command called without what it needs: its usage, then the message (argparse's own error), exit 2."""
        super().error(message)
