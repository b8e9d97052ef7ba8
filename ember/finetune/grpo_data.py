"""GRPO's prompts: the rows rollouts start from, each with the fields its rewards read (`answer`, ...).

Sources: a local .jsonl/.json/.parquet file, or a hub dataset by name (through `datasets`), of rows with a prompt
(`prompt`, or the field grpo.prompt_field names: text, or a list of messages rendered with the run's chat template
and a generation prompt; a row without it may give `messages`) and whatever the rewards need; or
`reasoning_gym:NAME` (reasoning-gym's procedural generator NAME, offline and seeded: its `question` is the prompt,
its `answer` the answer; the `.[rl]` extra). Every row is checked before any work: a missing prompt, a field a
reward reads, or a prompt too long to leave room for max_new_tokens is one line naming the file and line.

PromptLoader deals the rows to data-parallel ranks in a seeded order per epoch; its state (epoch, position) makes
a resume continue with the next prompts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ember.data.jsonl import read_json_rows
from ember.errors import ConfigError, DataError, UserFileNotFound

GYM_PREFIX = "reasoning_gym:"


@dataclass
class PromptRow:
    prompt_ids: list[int]
    row: dict[str, Any]  # the source's row: what the rewards read
    where: str  # file:line (or generator:index), for errors


def _gym_rows(spec: str, size: int, seed: int, options: Optional[dict] = None) -> list[tuple[str, dict]]:
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError(f"data.dataset={spec} needs reasoning-gym: pip install -e '.[rl]'") from None
    name = spec[len(GYM_PREFIX):]
    try:
        dataset = reasoning_gym.create_dataset(name, seed=seed, size=size, **(options or {}))
    except Exception as err:  # an unknown generator name, or its options
        raise ConfigError(f"{spec}: reasoning-gym cannot make generator '{name}' with options {options or {}} "
                          f"({type(err).__name__}: {err})") from None
    return [(f"{spec}:{i}", {"prompt": entry["question"], "answer": entry["answer"]})
            for i, entry in enumerate(dataset)]


def _table_rows(spec: str, split: str) -> list[tuple[str, dict]]:
    """Rows of a local parquet file or of a hub dataset, through `datasets` (offline: what its cache holds)."""
    from ember.data.hub import import_datasets

    datasets = import_datasets(f"GRPO prompts from {spec}")
    if Path(spec).suffix == ".parquet":
        table = datasets.load_dataset("parquet", data_files=str(Path(spec).expanduser()), split="train")
        return [(f"{spec} row {i}", dict(row)) for i, row in enumerate(table, 1)]
    try:
        table = datasets.load_dataset(spec, split=split)
    except Exception as err:  # no such dataset, no network, no such split: the user's to fix
        raise DataError(f"data.dataset '{spec}': cannot load it as a hub dataset ({type(err).__name__}: {err}); give "
                        f"a .jsonl/.json/.parquet file or {GYM_PREFIX}NAME") from None
    return [(f"{spec} row {i}", dict(row)) for i, row in enumerate(table, 1)]


def read_prompt_rows(spec: str, split: str = "train", gym_size: int = 1000, seed: int = 0,
                     gym_options: Optional[dict] = None) -> list[tuple[str, dict]]:
    """(where, row) of every row of `spec`: a reasoning_gym:NAME generator (with its `gym_options`), a local
    .jsonl/.json/.parquet file, or a hub dataset's `split`."""
    if spec.startswith(GYM_PREFIX):
        return _gym_rows(spec, gym_size, seed, gym_options)
    path = Path(spec).expanduser()
    if path.suffix == ".parquet" and path.is_file():
        return _table_rows(spec, split)
    if path.is_file() and path.suffix in (".jsonl", ".json"):
        return read_json_rows(path, "GRPO prompts")
    if path.is_file():
        raise DataError(f"data.dataset '{spec}': task=grpo reads .jsonl, .json or .parquet rows of prompts")
    if path.suffix or spec.startswith(("/", ".", "~")) or spec.count("/") > 1:
        raise UserFileNotFound(f"data.dataset '{spec}' does not exist; task=grpo reads a .jsonl/.json/.parquet of "
                               f"prompts, a hub dataset, or {GYM_PREFIX}NAME")
    return _table_rows(spec, split)


def prompt_of(row: dict, prompt_field: str = "prompt") -> Any:
    """A row's prompt: row[prompt_field] (text or messages), else its `messages`; None when it has neither."""
    value = row.get(prompt_field, row.get("messages"))
    return value if isinstance(value, str) or isinstance(value, list) else None


def load_prompts(spec: str, encode: Callable[[dict], list[int]], needs: Sequence[str], max_prompt_tokens: int,
                 gym_size: int = 1000, seed: int = 0, prompt_field: str = "prompt",
                 split: str = "train") -> list[PromptRow]:
    """Every row of `spec`, its prompt tokenized by `encode(row)` (which renders the text or the messages), checked
    for the fields in `needs` and for fitting max_prompt_tokens (seq_len - max_new_tokens)."""
    rows = read_prompt_rows(spec, split, gym_size, seed)
    if not rows:
        raise DataError(f"data.dataset '{spec}' holds no rows")
    prompts = []
    for where, row in rows:
        if prompt_of(row, prompt_field) is None:
            raise DataError(f"{where}: no '{prompt_field}' (text or messages) or 'messages' to start a completion "
                            "from; set grpo.prompt_field to the row's prompt column")
        missing = [name for name in needs if name not in row]
        if missing:
            raise DataError(f"{where}: no '{missing[0]}', which the rewards read (grpo.rewards)")
        try:
            ids = encode(row)
        except DataError as err:  # a chat prompt the template cannot render: named by its row
            raise DataError(f"{where}: {err}") from None
        if len(ids) > max_prompt_tokens:
            raise DataError(f"{where}: the prompt is {len(ids)} tokens, more than seq_len - grpo.max_new_tokens = "
                            f"{max_prompt_tokens}; shorten it, or raise seq_len or lower grpo.max_new_tokens")
        prompts.append(PromptRow(ids, row, where))
    return prompts


class PromptLoader:
    """Batches of `prompts_per_rank` rows for one data-parallel rank: each epoch a seeded permutation of every row,
    cut into global batches, rank r taking the r-th part of each (a tail shorter than a global batch is left out,
    as the token loaders do)."""

    def __init__(self, prompts: list[PromptRow], prompts_per_rank: int, dp_rank: int = 0, dp_world: int = 1,
                 seed: int = 0):
        global_batch = prompts_per_rank * dp_world
        if len(prompts) < global_batch:
            raise DataError(f"{len(prompts)} prompts are fewer than one step's {global_batch} (global_batch_size / "
                            "grpo.group_size); add prompts or lower global_batch_size")
        self.prompts, self.per_rank, self.seed = prompts, prompts_per_rank, seed
        self.rank, self.world = dp_rank, dp_world
        self.epoch, self.position = 0, 0  # position: global batches taken this epoch
        self._order: Optional[list[int]] = None

    def _permutation(self) -> list[int]:
        if self._order is None:
            self._order = list(range(len(self.prompts)))
            random.Random(f"{self.seed}-{self.epoch}").shuffle(self._order)
        return self._order

    def next_batch(self) -> list[PromptRow]:
        global_batch = self.per_rank * self.world
        if (self.position + 1) * global_batch > len(self.prompts):
            self.epoch, self.position, self._order = self.epoch + 1, 0, None
        start = self.position * global_batch + self.rank * self.per_rank
        self.position += 1
        return [self.prompts[i] for i in self._permutation()[start:start + self.per_rank]]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position, self._order = int(state["epoch"]), int(state["position"]), None
