"""The errors ember raises for a mistake in what the user gave it (config, data, files, checkpoints).

Each message names the problem and the fix in one line; the CLI prints an EmberError as `error: ...` and
exits with 2, and lets every other exception (a bug) show its traceback. Each class also derives from the
built-in a caller would catch for it (ValueError, FileNotFoundError).
"""

from __future__ import annotations

import difflib
from typing import Iterable


class EmberError(Exception):
    """A user-facing error: one line, naming the problem and the fix."""


class ConfigError(EmberError, ValueError):
    """A config key, value or combination that cannot work."""


class DataError(EmberError, ValueError):
    """Data or a tokenizer that cannot be read or used (empty, not UTF-8, a missing field, too small)."""


class CheckpointError(EmberError, ValueError):
    """A checkpoint or model file that is corrupt, incomplete, or does not fit the run."""


class UserFileNotFound(EmberError, FileNotFoundError):
    """A path the user gave does not exist or holds nothing ember can read."""


def did_you_mean(name: str, choices: Iterable[str], cutoff: float = 0.6) -> str:
    """` (did you mean 'X'?)` for the choice closest to a mistyped `name`, or "" when none is close enough."""
    by_lower = {choice.lower(): choice for choice in choices}  # case is a typo too: BF16 for bf16
    hint = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=cutoff)
    return f" (did you mean '{by_lower[hint[0]]}'?)" if hint else ""


def not_one_of(key: str, value: str, choices: Iterable[str]) -> ConfigError:
    """`key 'value' is not one of a, b, c (did you mean 'b'?)`: a config value outside its choices."""
    choices = list(choices)
    return ConfigError(f"{key} '{value}' is not one of {', '.join(choices)}{did_you_mean(value, choices)}")


def first_error_line(err: BaseException) -> str:
    """The gist of an exception for a one-line error: its first non-empty line, stripped, or its type's name
    when its text is empty. A first line that only introduces what follows (ends with ':', as torch's
    "Error(s) in loading state_dict for X:") takes the next line with it. For DCP's CheckpointException (a
    traceback per rank in its text), the first rank's own exception."""
    failures = getattr(err, "failures", None)  # DCP's CheckpointException: {rank: (exception, traceback)}
    if isinstance(failures, dict) and failures:
        err = next(iter(failures.values()))[0]
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    return " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]
