"""Fine-tuning's model formats, registered with ember/model_io/sources.py (its FORMATS name LORA_CHECKPOINT and
PEFT_ADAPTER here): a LoRA checkpoint (adapters only, on the base its model.json names, whose files must be
those it was trained on) and a peft adapter directory (on the local base its adapter_config.json names).
Either loads as its base with the adapters: unmerged for a LoRA checkpoint (training may resume on it),
folded in for a peft adapter and wherever the weights fill another model (model.init_from)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from ember.errors import CheckpointError, UserFileNotFound, first_error_line
from ember.finetune.base_fingerprint import check_lora_base
from ember.finetune.lora import LoraLinear, apply_lora, merge_lora, trainable_names
from ember.finetune.lora_state import START, buffer_names, lora_state_dict, moved_buffers, unsaved_buffers
from ember.finetune.peft_format import ADAPTER_CONFIG, check_adapter_config, is_peft_dir, merge_peft_adapter, peft_base
from ember.model_io.load import _quiet_dcp, copy_whole, load_model, source_architecture
from ember.model_io.model_meta import (
    MODEL_JSON,
    build_on_meta,
    ember_step_dir,
    parse_model_meta,
    read_json,
    read_model_json,
)
from ember.model_io.sources import Architecture, Device, ModelParts, SourceFormat
from ember.models import family_of

# ---- LoRA checkpoints: an ember checkpoint whose model.json says "lora" ----------------------------------


def _lora_step_dir(path: Path) -> Optional[Path]:
    """The LoRA checkpoint a path names (a step-N directory, or a run directory's newest), or None."""
    step_dir = ember_step_dir(path)
    return step_dir if step_dir is not None and "lora" in read_json(step_dir / MODEL_JSON) else None


def _lora_architecture(path: Path) -> Architecture:
    step_dir = _lora_step_dir(path)
    assert step_dir is not None, path
    return Architecture(*read_model_json(step_dir / MODEL_JSON), step_dir / MODEL_JSON)  # the base's, as saved


@torch.no_grad()
def _load_lora(path: Path, device: Device, dtype: torch.dtype) -> nn.Module:
    """A LoRA checkpoint: its base (meta["base"], model.init_from of the run) with the saved adapters, unmerged."""
    step_dir = _lora_step_dir(path)
    assert step_dir is not None, path
    meta = read_json(step_dir / MODEL_JSON)
    parse_model_meta(meta, step_dir / MODEL_JSON)  # a bad description is the error, before its base is looked for
    base = meta.get("base")
    if not isinstance(base, str) or not Path(base).exists():
        raise UserFileNotFound(f"'{step_dir}' holds LoRA adapters for the base '{base}', which is gone; put the base "
                               f'back there (or point "base" in its {MODEL_JSON} at it)')
    check_lora_base(step_dir, meta)  # adapters on a base overwritten since would give other logits, silently
    model = load_model(base, device, dtype)
    merge_lora(model)  # a base that is itself a LoRA run; another architecture fails the load below, naming the tensor
    apply_lora(model, family=meta["family"], **meta["lora"])
    for module in model.modules():
        if isinstance(module, LoraLinear):
            module.lora_A.to(device, dtype), module.lora_B.to(device, dtype)
    state = {"model": lora_state_dict([model])}  # the adapters, and the buffers training moved (router score biases)
    unsaved_buffers(step_dir, state, buffer_names([model]))  # a checkpoint from before they were kept: the base's
    try:
        _quiet_dcp(dcp.load, state, checkpoint_id=str(step_dir))
    except (RuntimeError, ValueError, OSError, CheckpointException) as err:
        raise CheckpointError(f"'{step_dir}': its adapters do not fit its base '{base}' "
                              f"({first_error_line(err)})") from None
    return model


def _lora_into(model: ModelParts, path: Path) -> Path:
    """A LoRA run as a base for another (model.init_from): its base with the adapters folded in."""
    step_dir = _lora_step_dir(path)
    assert step_dir is not None, path
    source = load_model(step_dir)
    merge_lora(source)
    copy_whole(model, source, step_dir)
    return step_dir


LORA_CHECKPOINT = SourceFormat("LoRA checkpoint", lambda path: _lora_step_dir(path) is not None,
                               _lora_architecture, _load_lora, _lora_into)


def adapter_tensors(step_dir: Path, meta: dict[str, Any]) -> tuple[Any, dict[str, torch.Tensor], list[str]]:
    """(args, {name: tensor} of a LoRA checkpoint's trainable tensors, the buffers its training moved), read without
    loading the base (`ember convert` of the adapters alone)."""
    family, _, args = read_model_json(step_dir / MODEL_JSON)
    model = build_on_meta(family, args, torch.float32)
    apply_lora(model, family=family, **meta["lora"])
    names, buffers = sorted(trainable_names([model])), buffer_names([model])
    shapes = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    state = {"model": {name: torch.empty(shapes[name].shape) for name in [*names, *buffers]}}
    if buffers:  # and their values when the run started, which tell whether training moved them
        state[START] = {name: torch.empty(shapes[name].shape) for name in buffers}
    unsaved_buffers(step_dir, state, buffers)
    try:
        _quiet_dcp(dcp.load, state, checkpoint_id=str(step_dir))
    except (RuntimeError, ValueError, OSError, CheckpointException) as err:
        raise CheckpointError(f"'{step_dir}': its adapters do not fit its {MODEL_JSON} "
                              f"({first_error_line(err)})") from None
    moved = moved_buffers({name: state["model"].pop(name) for name in buffers if name in state["model"]},
                          state.get(START, {}))
    return args, state["model"], moved


# ---- peft adapter directories ---------------------------------------------------------------------------


def _peft_base(adapter_dir: Path) -> Path:
    return peft_base(check_adapter_config(read_json(adapter_dir / ADAPTER_CONFIG), adapter_dir), adapter_dir)


@torch.no_grad()
def _load_peft(adapter_dir: Path, device: Device, dtype: torch.dtype) -> nn.Module:
    """A peft adapter directory: its base (base_model_name_or_path, local) with the adapter folded in."""
    config = read_json(adapter_dir / ADAPTER_CONFIG)
    model = load_model(_peft_base(adapter_dir), device, torch.float32)
    merge_lora(model)  # a base that is itself a LoRA run
    merge_peft_adapter(model, family_of(model), config, adapter_dir)
    model.to(dtype)
    model.init_rope(torch.device(device))  # the RoPE tables stay fp32
    return model


def _peft_into(model: ModelParts, adapter_dir: Path) -> Path:
    copy_whole(model, load_model(adapter_dir), adapter_dir)
    return adapter_dir


PEFT_ADAPTER = SourceFormat("peft adapter directory", is_peft_dir,
                            lambda path: source_architecture(_peft_base(path)),  # the adapter's base's
                            _load_peft, _peft_into)
