"""What a model path is: the registry of source formats that ember/model_io/load.py reads.

A source format answers the questions loading asks of a path, once detected: which architecture it
describes (family, flavor, typed args, the file that says so), the whole model it holds, and its weights
copied into a model already built (maybe sharded). The core formats (ember checkpoints, Hugging Face
directories, `ember convert --to torch` files) live in ember/model_io/load.py; fine-tuning registers its own (LoRA
checkpoints, peft adapter directories) from ember/finetune/sources.py. Entries are "module:attribute" strings,
resolved when a path is first detected, so the loading layer imports no fine-tuning module and no
registration depends on which module happened to be imported first (as ember/train/engines.py does for engines).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Union

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ember.nn.args import DecoderArgs

Device = Union[str, "torch.device"]
ModelParts = Union["nn.Module", list["nn.Module"]]  # a model, or this rank's pipeline stages


class Architecture(NamedTuple):
    """What a source describes, read without loading a weight: a tuple so callers may unpack it."""

    family: str
    flavor: str
    args: DecoderArgs
    where: Path  # the file it was read from (config.json or model.json): errors name it


@dataclass(frozen=True)
class SourceFormat:
    """One kind of model path. Each callable takes the path as the user gave it."""

    name: str
    detect: Callable[[Path], bool]  # whether the path is of this format (the first match in FORMATS wins)
    architecture: Callable[[Path], Architecture]
    load: Callable[[Path, Device, "torch.dtype"], "nn.Module"]  # the whole model, its parameters in dtype
    # the weights into a built model (FSDP/TP DTensors, pipeline stages) in place; returns the path read
    load_into: Callable[[ModelParts, Path], Path]


# In detection order: a LoRA checkpoint is an ember checkpoint with more in its model.json, so it comes first;
# an ember run or checkpoint directory before a peft adapter before an HF directory, as load_model always tried.
FORMATS: tuple[str, ...] = (
    "ember.model_io.load:TORCH_FILE",
    "ember.finetune.sources:LORA_CHECKPOINT",
    "ember.model_io.load:EMBER_CHECKPOINT",
    "ember.finetune.sources:PEFT_ADAPTER",
    "ember.model_io.load:HF_DIRECTORY",
)

# Predicates on state-dict keys that a fine-tuning method adds to a model (LoRA's adapters): no base checkpoint
# holds them, so filling a model from a base skips them.
ADDED_KEYS: tuple[str, ...] = ("ember.finetune.lora:is_adapter_key",)


def _attribute(path: str) -> Any:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


@functools.cache
def formats() -> tuple[SourceFormat, ...]:
    return tuple(_attribute(entry) for entry in FORMATS)


def find_format(path: Path) -> Optional[SourceFormat]:
    """The format of an existing path, or None (the caller's error names what it expected)."""
    return next((fmt for fmt in formats() if fmt.detect(path)), None)


@functools.cache
def _added_key_checks() -> tuple[Callable[[str], bool], ...]:
    return tuple(_attribute(entry) for entry in ADDED_KEYS)


def is_added_key(key: str) -> bool:
    """Whether a state-dict key is a fine-tuning method's addition (not the base model's)."""
    return any(check(key) for check in _added_key_checks())
