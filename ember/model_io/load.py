"""`load_model(path)`: an ember run or checkpoint directory, a Hugging Face model directory, or a torch file.

Weights are read only through safetensors (HF) or torch.distributed.checkpoint (ember), never by
unpickling a file someone handed us, and no remote code runs. Models are built on the meta device and
filled once, so a large model never sits in memory twice.

An ember checkpoint is `<run>/checkpoints/step-N/`: the DCP files of {"model": model.state_dict()} plus
model.json = {"family", "flavor", "args"}, enough to rebuild the model without the recipe. Hugging Face
directories are read by ember/model_io/hf_directory.py; model.json by ember/model_io/model_meta.py. Which format a
path is comes from ember/model_io/sources.py's registry, once per question: this module defines the core formats
(TORCH_FILE, EMBER_CHECKPOINT, HF_DIRECTORY) and fine-tuning registers its own (LoRA checkpoints, peft
adapters), so nothing here imports ember/finetune.
"""

from __future__ import annotations

import warnings
import zipfile
from pathlib import Path
from typing import Any, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from ember.errors import CheckpointError, UserFileNotFound, first_error_line
from ember.model_io.hf_directory import hf_family, hf_tensors, load_hf_model
from ember.model_io.model_meta import MODEL_JSON, build_on_meta, ember_step_dir, parse_model_meta, read_model_json
from ember.model_io.sources import Architecture, Device, ModelParts, SourceFormat, find_format, is_added_key
from ember.models import MODELS
from ember.storage.cache import local_copy

MODEL_PATHS = (f"an ember run or checkpoint directory ({MODEL_JSON}, checkpoints/step-N), a HF model directory "
               "(config.json) or an `ember convert --to torch` file")


# ---- what every format shares: process helpers, state dicts, the HF stream ------------------------------


def _is_rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _quiet_dcp(fn: Any, *args: Any, **kwargs: Any) -> None:
    with warnings.catch_warnings():  # DCP warns when there is no process group; one process is the intent
        warnings.simplefilter("ignore", UserWarning)
        fn(*args, **kwargs)


def model_state_dict(model: ModelParts) -> dict[str, Any]:
    """The state dict of a model, or of this rank's pipeline stages merged (their names do not overlap:
    a stage keeps the whole model's names)."""
    state: dict[str, Any] = {}
    for part in model if isinstance(model, (list, tuple)) else [model]:
        state.update(part.state_dict())
    return state


def base_state_dict(model: ModelParts) -> dict[str, Any]:
    """model_state_dict without what fine-tuning added (LoRA adapters): what a base checkpoint (model.init_from)
    fills."""
    return {k: v for k, v in model_state_dict(model).items() if not is_added_key(k)}


@torch.no_grad()
def load_hf_weights(model: ModelParts, directory: Path) -> None:
    """Copy a Hugging Face directory's weights into `model` (maybe sharded: FSDP/TP DTensors, pipeline
    stages), tensor by tensor: each is mapped to ember's layout by the family's from_hf_state_dict (the one
    mapping load_hf_model uses; a fused tensor, Phi-3's qkv_proj, gives several), and only this rank's shard
    kept. The mapping runs first on a meta tensor of the stored shape, so a tensor no stage here holds is not read."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    family, config = hf_family(directory)
    hf = MODELS[family].hf
    args = hf.args_from_hf_config(config)
    if args.has_experts:  # per-expert HF tensors are stacked on load; not streamed into shards yet
        raise CheckpointError(f"model.init_from: streaming a {family} Hugging Face directory "
                              "(its experts change layout on load) is not supported yet; "
                              f"convert it first (`ember convert {directory} CKPT`) and use model.init_from=CKPT")
    targets = base_state_dict(model)
    loaded: set[str] = set()
    for stored in hf_tensors(directory):
        try:
            names = hf.from_hf_state_dict({stored.name: torch.empty(stored.shape, device="meta")}, args)
        except KeyError as err:
            raise CheckpointError(f"'{stored.file}': {err.args[0]}") from None
        except (RuntimeError, ValueError) as err:  # a fused tensor that does not split as config.json says
            raise CheckpointError(f"'{stored.file}': {stored.name} of shape {stored.shape} does not fit config.json "
                                  f"({first_error_line(err)}); match the model config to config.json") from None
        if not any(name in targets for name in names):
            continue  # another pipeline stage's weights, or none of ember's (a tied lm_head)
        for name, full in hf.from_hf_state_dict({stored.name: stored.read()}, args).items():
            target = targets.get(name)
            if target is None:
                continue
            if tuple(full.shape) != tuple(target.shape):
                raise CheckpointError(f"'{stored.file}': {stored.name} has shape {tuple(full.shape)} but this run's "
                                      f"model has {tuple(target.shape)} for {name}; "
                                      "match the model config to config.json")
            if isinstance(target, DTensor):
                shard = distribute_tensor(full.to(target.dtype), target.device_mesh, target.placements,
                                          src_data_rank=None)
                target.to_local().copy_(shard.to_local())
            else:
                target.copy_(full)
            loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if missing:
        raise CheckpointError(f"'{directory}' has no weight for {missing[0]} (and {len(missing) - 1} more)")


def source_architecture(path: Union[str, Path]) -> Architecture:
    """(family, flavor, args, the file they were read from) of what model.init_from names: an HF directory's
    config.json, or an ember checkpoint's model.json (a run directory: its newest complete step; a LoRA
    checkpoint's or a peft adapter's: its base's)."""
    path = local_copy(path, "model.init_from")
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"model.init_from '{path}' is not a model: a model for init_from is a checkpoints/"
                              "step-N, run or HF directory, not a file")
    if not path.is_dir():
        raise UserFileNotFound(f"model.init_from '{path}' does not exist; "
                               "give a checkpoints/step-N, run or HF directory")
    return _directory_format(path).architecture(path)


def load_weights(model: ModelParts, path: Union[str, Path]) -> Path:
    """Load weights into `model` in place, resharded to its layout: an ember checkpoint (a step-N
    directory, or a run directory's newest; DCP reads only the shards this rank needs), a Hugging Face
    directory (config.json + safetensors), or a LoRA checkpoint or peft adapter with its base (merged).
    Returns the directory read."""
    path = local_copy(path, "model.init_from")
    if not path.is_dir():
        raise UserFileNotFound(f"model.init_from '{path}' does not exist; "
                               "give a checkpoints/step-N, run or HF directory")
    return _directory_format(path).load_into(model, path)


@torch.no_grad()
def load_model(path: Union[str, Path], device: Device = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model stored at `path`, in eval mode: `model(tokens (B, T)) -> logits (B, T, vocab)`.

    `path` is an ember checkpoint (`<run>/checkpoints/step-N`), a run directory (its newest complete
    step), a Hugging Face directory (config.json and safetensors weights), a peft adapter directory, or the
    torch.save file that `ember convert --to torch` writes. Parameters come in `dtype`; the RoPE tables stay fp32.
    A URL is read through its local copy (ember/storage/cache.py).
    """
    path = local_copy(path)
    if not path.exists():
        raise UserFileNotFound(f"'{path}' does not exist (expected {MODEL_PATHS})")
    fmt = find_format(path)
    if fmt is None:
        raise UserFileNotFound(f"'{path}' holds no model (expected {MODEL_PATHS})")
    return fmt.load(path, device, dtype).eval()


def _directory_format(path: Path) -> SourceFormat:
    """The format of a model.init_from directory, or the error both its questions give for none."""
    fmt = find_format(path)
    if fmt is None:
        raise UserFileNotFound(f"'{path}' is neither an ember checkpoint (no {MODEL_JSON}) nor a run directory")
    return fmt


@torch.no_grad()
def copy_whole(model: ModelParts, source: nn.Module, where: Path) -> None:
    """Copy a whole model (read on every rank: a peft adapter or a LoRA run, merged) into `model`'s shards."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    full_state = source.state_dict()
    for name, target in base_state_dict(model).items():
        full = full_state.get(name)
        if full is None or tuple(full.shape) != tuple(target.shape):
            raise CheckpointError(f"'{where}' does not fit this run's model at {name}; match the model config to it")
        if isinstance(target, DTensor):
            shard = distribute_tensor(full.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None)
            target.to_local().copy_(shard.to_local())
        else:
            target.copy_(full)


# ---- the core formats ---------------------------------------------------------------------------------


def _step_dir(path: Path) -> Path:
    """The checkpoint an ember path names (detect said it is one)."""
    step_dir = ember_step_dir(path)
    assert step_dir is not None, path
    return step_dir


def _ember_architecture(path: Path) -> Architecture:
    step_dir = _step_dir(path)
    return Architecture(*read_model_json(step_dir / MODEL_JSON), step_dir / MODEL_JSON)


def _load_ember(path: Path, device: Device, dtype: torch.dtype) -> nn.Module:
    step_dir = _step_dir(path)
    family, _, args = read_model_json(step_dir / MODEL_JSON)
    model = build_on_meta(family, args, dtype)
    model.to_empty(device=device)
    model.tie_weights()
    model.init_rope()
    state = {"model": model.state_dict()}
    # In place into the model's own tensors; DCP reads tensors with weights_only unpickling and
    # converts to the model's dtype as it copies.
    try:
        _quiet_dcp(dcp.load, state, checkpoint_id=str(step_dir))
    except (RuntimeError, ValueError, OSError, CheckpointException) as err:  # missing or mis-shaped tensors
        raise CheckpointError(f"'{step_dir}': its weights do not fit its {MODEL_JSON} "
                              f"({first_error_line(err)})") from None
    return model


def _ember_into(model: ModelParts, path: Path) -> Path:
    step_dir = _step_dir(path)
    _quiet_dcp(dcp.load, {"model": base_state_dict(model)}, checkpoint_id=str(step_dir))
    return step_dir


# An ember run (its newest complete step) or checkpoints/step-N directory: ember_step_dir raises for a run
# directory with no complete step, which is the error every question about it should give.
EMBER_CHECKPOINT = SourceFormat("ember checkpoint", lambda path: ember_step_dir(path) is not None,
                                _ember_architecture, _load_ember, _ember_into)


def _hf_architecture(path: Path) -> Architecture:
    family, config = hf_family(path)
    try:
        args = MODELS[family].hf.args_from_hf_config(config)
    except (KeyError, ValueError) as err:
        raise CheckpointError(f"'{path / 'config.json'}': {err}") from None
    return Architecture(family, "custom", args, path / "config.json")


def _hf_into(model: ModelParts, path: Path) -> Path:
    load_hf_weights(model, path)
    return path


HF_DIRECTORY = SourceFormat("Hugging Face directory", lambda path: (path / "config.json").is_file(),
                            _hf_architecture, load_hf_model, _hf_into)


def _read_torch_file(path: Path) -> dict[str, Any]:
    if not zipfile.is_zipfile(path):  # torch.save's format; else torch's own message is about mmap
        raise CheckpointError(f"'{path}' is not a model: a model path is {MODEL_PATHS}")
    try:  # weights_only: a checkpoint file is data; mmap: the tensors stay on disk until copied
        payload = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    except Exception as err:
        raise CheckpointError(f"'{path}' is not a torch.save file ember can read safely "
                              f"({first_error_line(err)})") from None
    if not isinstance(payload, dict) or "model" not in payload or "ember" not in payload:
        raise CheckpointError(f"'{path}' holds no {{'model': state_dict, 'ember': model.json}}; "
                              "write it with ember convert")
    return payload


def _load_torch_file(path: Path) -> nn.Module:
    """An `ember convert --to torch` file on the CPU in fp32, its tensors still mapped from the file."""
    payload = _read_torch_file(path)
    family, _, args = parse_model_meta(payload["ember"], path)
    model = build_on_meta(family, args, torch.float32)
    try:
        model.load_state_dict(payload["model"], strict=True, assign=True)
    except RuntimeError as err:  # missing, unexpected or mis-shaped tensors: the message's first line says which
        raise CheckpointError(f"'{path}': its weights do not fit its {family} description "
                              f"({first_error_line(err)})") from None
    model.tie_weights()
    model.init_rope(torch.device("cpu"))
    return model


def _torch_file_architecture(path: Path) -> Architecture:
    return Architecture(*parse_model_meta(_read_torch_file(path)["ember"], path), path)


def _load_torch_file_as(path: Path, device: Device, dtype: torch.dtype) -> nn.Module:
    model = _load_torch_file(path).to(device=device, dtype=dtype)
    model.init_rope(torch.device(device))  # the RoPE tables stay fp32
    return model


def _torch_file_into(model: ModelParts, path: Path) -> Path:
    copy_whole(model, _load_torch_file(path), path)
    return path


# model.init_from refuses files before asking (source_architecture, load_weights): load_model reads them
TORCH_FILE = SourceFormat("ember convert --to torch file", Path.is_file, _torch_file_architecture,
                          _load_torch_file_as, _torch_file_into)
