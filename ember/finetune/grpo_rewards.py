"""GRPO's verifiable rewards: each a function (prompt, completion, row) -> float, where `row` is the dataset row the
prompt came from (its `answer` and whatever fields a reward reads).

Built in:
- `exact`: 1 if the completion's final answer equals the row's `answer` after normalization, else 0. The final
  answer is the last \\boxed{...}, else what follows the last `####` (GSM8K's convention), else the whole
  completion; normalization lowercases, collapses whitespace, drops `$`, a trailing period and the thousands
  commas of numbers ("1,000." -> "1000").
- `math`: 1 if math-verify (the `.[rl]` extra) finds the completion's answer mathematically equal to the row's
  (`\\frac{1}{2}` and `0.5`), else 0; parsing and verification each bounded by its timeout.
- `format`: 1 if the whole completion matches a regular expression (`format_pattern`, `.` matching newlines).
And any `module:function` importable from the run's environment, called the same way.

A reward that raises or runs past its time is one line naming the function and the row; with on_error="zero" it
scores 0 instead, and the error is counted (the trainer reports the count).
"""

from __future__ import annotations

import importlib
import math as _math  # (the module's `math` is the reward)
import re
import signal
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from ember.errors import ConfigError, EmberError

Reward = Callable[[str, str, Mapping[str, Any]], float]
BUILT_IN = ("exact", "math", "format")
NEEDS = {"exact": ("answer",), "math": ("answer",)}  # the row fields a built-in reward reads
TIMEOUT_S = 5


class RewardError(EmberError, RuntimeError):
    """A reward function failed on a row: the message names both."""


def final_answer(text: str) -> str:
    """The last \\boxed{...} (braces balanced), else what follows the last ####, else the text."""
    start = text.rfind("\\boxed{")
    if start >= 0:
        depth, i = 1, start + len("\\boxed{")
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i:j]
    if "####" in text:
        return text.rsplit("####", 1)[1]
    return text


def normalize(text: str) -> str:
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text.replace("$", ""))
    return " ".join(text.lower().split()).strip().rstrip(".").strip()


def exact(prompt: str, completion: str, row: Mapping[str, Any]) -> float:
    return float(normalize(final_answer(completion)) == normalize(str(row["answer"])))


def math(prompt: str, completion: str, row: Mapping[str, Any]) -> float:
    try:
        from math_verify import parse, verify
    except ImportError:
        raise ConfigError("the math reward needs math-verify: pip install -e '.[rl]'") from None
    # math-verify's own timeouts use SIGALRM, which only the main thread may set
    timeout = TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = parse(str(row["answer"]), parsing_timeout=timeout)
    return float(verify(gold, parse(completion, parsing_timeout=timeout), timeout_seconds=timeout))


def format_reward(pattern: str) -> Reward:
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as err:
        raise ConfigError(f"grpo.format_pattern {pattern!r} is not a regular expression: {err}") from None

    def format_match(prompt: str, completion: str, row: Mapping[str, Any]) -> float:
        return float(compiled.fullmatch(completion) is not None)

    return format_match


def load_reward(name: str, format_pattern: Optional[str] = None) -> Reward:
    """A built-in reward by name, or `module:function` imported from the environment; a bad name is one line."""
    if name == "exact":
        return exact
    if name == "math":
        return math
    if name == "format":
        if not format_pattern:
            raise ConfigError("the format reward needs grpo.format_pattern (a regular expression the whole "
                              "completion must match)")
        return format_reward(format_pattern)
    module_name, colon, function = name.partition(":")
    if not colon or not module_name or not function:
        raise ConfigError(f"reward '{name}': choose one of {', '.join(BUILT_IN)}, or give module:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or the module failing as it loads: both the user's to fix
        raise ConfigError(f"reward '{name}': cannot import {module_name} ({type(err).__name__}: {err}); put it on "
                          "PYTHONPATH") from None
    fn = getattr(module, function, None)
    if not callable(fn):
        raise ConfigError(f"reward '{name}': {module_name} has no function {function}")
    return fn


def _with_timeout(fn: Reward, args: tuple, seconds: float) -> float:
    """fn(*args), stopped after `seconds` where this is the main thread (SIGALRM); elsewhere unbounded."""
    if threading.current_thread() is not threading.main_thread():
        return fn(*args)

    def expire(_signum: int, _frame: object) -> None:
        raise TimeoutError(f"ran past {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclass
class Rewards:
    """The run's reward functions, their weights, and what to do when one fails ("fail" or "zero")."""

    names: list[str]
    functions: list[Reward]
    weights: list[float]
    on_error: str = "fail"
    timeout_s: float = TIMEOUT_S
    errors: list[int] = field(default_factory=list)  # per function, since this process started

    def __post_init__(self) -> None:
        self.errors = self.errors or [0] * len(self.functions)

    def score(self, prompts: Sequence[str], completions: Sequence[str], rows: Sequence[Mapping[str, Any]],
              where: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(N,) weighted total and (N, k) per-function rewards; `where` names each row (file:line) for errors."""
        per = torch.zeros(len(completions), len(self.functions))
        for i, (prompt, completion, row) in enumerate(zip(prompts, completions, rows)):
            for k, fn in enumerate(self.functions):
                try:  # (math bounds itself, with the same alarm)
                    value = fn(prompt, completion, row) if fn is math else _with_timeout(
                        fn, (prompt, completion, row), self.timeout_s)
                    per[i, k] = float(value)
                    if not _math.isfinite(per[i, k].item()):  # NaN or inf would skip every step as non-finite
                        raise ValueError(f"returned {value!r}, not a finite number")
                except ConfigError:
                    raise
                except Exception as err:
                    if self.on_error != "zero":
                        raise RewardError(f"reward {self.names[k]} failed on {where[i]}: {type(err).__name__}: "
                                          f"{err} (grpo.reward_errors=zero scores such a completion 0)") from None
                    per[i, k] = 0.0
                    self.errors[k] += 1
        return per @ torch.tensor(self.weights, dtype=per.dtype), per


def build_rewards(names: Sequence[str], weights: Optional[Sequence[float]], format_pattern: Optional[str],
                  on_error: str = "fail") -> Rewards:
    """The run's rewards from grpo.rewards / grpo.reward_weights (default: 1 each) / grpo.reward_errors."""
    if not names:
        raise ConfigError("grpo.rewards is empty: name at least one (exact, math, format or module:function)")
    weights = list(weights) if weights else [1.0] * len(names)
    if not all(_math.isfinite(float(w)) for w in weights):
        raise ConfigError(f"grpo.reward_weights={list(weights)}: each weight must be a finite number")
    if len(weights) != len(names):
        raise ConfigError(f"grpo.reward_weights has {len(weights)} values for {len(names)} grpo.rewards; give one "
                          "weight per reward")
    if on_error not in ("fail", "zero"):
        raise ConfigError(f"grpo.reward_errors={on_error!r}: choose fail or zero")
    return Rewards(list(names), [load_reward(n, format_pattern) for n in names], [float(w) for w in weights],
                   on_error)
