"""What a LoRA checkpoint holds of the model, beside the optimizer's state and the base's path and fingerprint: the
trainable tensors (the adapters; the embeddings and norms with lora.train_*) and every persistent buffer, with the
buffers' values when the run started.

Buffers are state no optimizer owns that training may still move: DeepSeek-V3's router score biases follow each
step's expert loads (nn/moe.update_score_bias) under LoRA as in full training. Saved with the adapters alone, they
were lost: a resumed run routed by the base's biases again, and eval, generate and convert ran the base's. Every
persistent buffer is kept, not those known to move: they are small (a vector per router), and a buffer added later
is kept without anyone remembering to. Their start values (START) tell `ember convert --to peft` whether training
moved them without reading the base: a peft adapter holds lora_A and lora_B only, so moved buffers are refused there
(`--merge` carries them into the model).

A checkpoint saved before buffers were kept is read as it is: its buffers stay the base's (`unsaved_buffers`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from ember.finetune.lora import trainable_names

START = "start_buffers"  # the checkpoint's key of the buffers' values when the run started


def buffer_names(model_parts: Sequence[nn.Module]) -> set[str]:
    """State-dict names of the persistent buffers (the non-persistent ones, RoPE tables, are derived on load)."""
    names: set[str] = set()
    for part in model_parts:
        params = {name for name, _ in part.named_parameters(remove_duplicate=False)}
        names.update(name for name in part.state_dict() if name not in params)
    return names


def lora_state_dict(model_parts: Sequence[nn.Module]) -> dict[str, Any]:
    """What a LoRA checkpoint holds of the model: the trainable tensors and the persistent buffers."""
    names = trainable_names(model_parts) | buffer_names(model_parts)
    state: dict[str, Any] = {}
    for part in model_parts:
        state.update({k: v for k, v in part.state_dict().items() if k in names})
    return state


def start_buffers(model_parts: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
    """Copies of the persistent buffers as they are now: taken before the first step, the base's."""
    names = buffer_names(model_parts)
    return {k: v.detach().clone() for part in model_parts for k, v in part.state_dict().items() if k in names}


def unsaved_buffers(step_dir: Path, state: dict[str, Any], buffers: set[str]) -> list[str]:
    """Drop from `state` (what a load of the LoRA checkpoint `step_dir` asks for: {"model": ..., START: ...}) the
    `buffers` the checkpoint does not hold, saved before buffers were kept; returns their names, sorted (the model
    keeps the base's values of them)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        stored = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    except Exception:  # an unreadable checkpoint: the load that follows says so, naming it
        return []
    dropped = sorted(name for name in buffers if f"model.{name}" not in stored)
    for name in dropped:
        for section in ("model", START):
            state.get(section, {}).pop(name, None)
    return dropped


def moved_buffers(buffers: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> list[str]:
    """The names of the buffers whose values differ from their start values, sorted."""
    return sorted(name for name, value in buffers.items() if name in start and not torch.equal(value, start[name]))
