"""`load_model(path)`: an ember run or checkpoint directory, or a Hugging Face model directory.

Weights are read only through safetensors (HF) or torch.distributed.checkpoint (ember), never by
unpickling a file someone handed us, and no remote code runs. Models are built on the meta device and
filled once, so a large model never sits in memory twice.

An ember checkpoint is `<run>/checkpoints/step-N/`: the DCP files of {"model": model.state_dict()} plus
model.json = {"family", "flavor", "args"}, enough to rebuild the model without the recipe. Hugging Face
directories are read by ember/hf_directory.py; model.json by ember/model_meta.py.
"""

from __future__ import annotations

import dataclasses
import warnings
import zipfile
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch import nn

from ember.errors import CheckpointError, ConfigError, UserFileNotFound, first_error_line
from ember.finetune.base_fingerprint import check_lora_base
from ember.finetune.lora import LoraLinear, apply_lora, is_adapter_key, merge_lora, trainable_names
from ember.finetune.lora_state import START, buffer_names, lora_state_dict, moved_buffers, unsaved_buffers
from ember.finetune.peft_format import check_adapter_config, is_peft_dir, merge_peft_adapter, peft_base
from ember.hf_directory import hf_family, hf_tensors, load_hf_model
from ember.model_meta import (MODEL_JSON, build_on_meta, ember_step_dir, newest_step_dir, parse_model_meta, read_json,
                              read_model_json)
from ember.models import MODELS, family_of

MODEL_PATHS = (f"an ember run or checkpoint directory ({MODEL_JSON}, checkpoints/step-N), a HF model directory "
               "(config.json) or an `ember convert --to torch` file")
Device = Union[str, torch.device]


# ---- ember checkpoints (DCP) ------------------------------------------------------------------------


def _is_rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _quiet_dcp(fn, *args, **kwargs) -> None:
    with warnings.catch_warnings():  # DCP warns when there is no process group; one process is the intent
        warnings.simplefilter("ignore", UserWarning)
        fn(*args, **kwargs)


def model_state_dict(model: Union[nn.Module, list[nn.Module]]) -> dict[str, Any]:
    """The state dict of a model, or of this rank's pipeline stages merged (their names do not overlap:
    a stage keeps the whole model's names)."""
    state: dict[str, Any] = {}
    for part in model if isinstance(model, (list, tuple)) else [model]:
        state.update(part.state_dict())
    return state


def base_state_dict(model: Union[nn.Module, list[nn.Module]]) -> dict[str, Any]:
    """model_state_dict without LoRA adapters: what a base checkpoint (model.init_from) fills."""
    return {k: v for k, v in model_state_dict(model).items() if not is_adapter_key(k)}


@torch.no_grad()
def load_hf_weights(model: Union[nn.Module, list[nn.Module]], directory: Path) -> None:
    """Copy a Hugging Face directory's weights into `model` (maybe sharded: FSDP/TP DTensors, pipeline
    stages), tensor by tensor: each is mapped to ember's layout by the family's from_hf_state_dict (the one
    mapping load_hf_model uses; a fused tensor, Phi-3's qkv_proj, gives several), and only this rank's shard
    kept. The mapping runs first on a meta tensor of the stored shape, so a tensor no stage here holds is not read."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    family, config = hf_family(directory)
    hf = MODELS[family].hf
    args = hf.args_from_hf_config(config)
    if args.has_experts:  # per-expert HF tensors are stacked on load; not streamed into shards yet
        raise CheckpointError(f"model.init_from: streaming a {family} Hugging Face directory (its experts change layout on load) is not "
                         f"supported yet; convert it first (`ember convert {directory} CKPT`) and use model.init_from=CKPT")
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
                                      f"model has {tuple(target.shape)} for {name}; match the model config to config.json")
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


@dataclasses.dataclass(frozen=True)
class ModelChoice:
    """The model a run trains: its family, flavor label and hyper-parameters, and where they came from."""

    family: str
    flavor: str
    args: Any
    source: Optional[str] = None  # model.init_from's description file, when the architecture comes from it


def source_architecture(path: Union[str, Path]) -> tuple[str, str, Any, Path]:
    """(family, flavor, args, the file they were read from) of what model.init_from names: an HF directory's
    config.json, or an ember checkpoint's model.json (a run directory: its newest complete step)."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"model.init_from '{path}' is not a model: a model for init_from is a checkpoints/"
                              "step-N, run or HF directory, not a file")
    if not path.is_dir():
        raise UserFileNotFound(f"model.init_from '{path}' does not exist; give a checkpoints/step-N, run or HF directory")
    if is_peft_dir(path):  # an adapter: the architecture is its base's
        return source_architecture(_peft_base(path))
    if (path / "config.json").is_file() and not (path / MODEL_JSON).is_file():
        family, config = hf_family(path)
        try:
            args = MODELS[family].hf.args_from_hf_config(config)
        except (KeyError, ValueError) as err:
            raise CheckpointError(f"'{path / 'config.json'}': {err}") from None
        return family, "custom", args, path / "config.json"
    step_dir = ember_step_dir(path)
    if step_dir is None:
        raise UserFileNotFound(f"'{path}' is neither an ember checkpoint (no {MODEL_JSON}) nor a run directory")
    family, flavor, args = read_model_json(step_dir / MODEL_JSON)
    return family, flavor, args, step_dir / MODEL_JSON


def source_family(recipe_family: str, init_from: str) -> str:
    """The family a run with model.init_from builds when the command line names none: the source's, as its
    model.json says; an HF directory's config.json does not say which Llama it is, so there the recipe's family
    stands when it is a Llama too."""
    src_family, _, _, where = source_architecture(init_from)
    same_kind = recipe_family in MODELS and MODELS[recipe_family].args_cls is MODELS[src_family].args_cls
    return recipe_family if where.name != MODEL_JSON and same_kind else src_family


def resolve_model(family: str, flavor: str, overrides: dict[str, Any], init_from: Optional[str]) -> ModelChoice:
    """The run's model. Without init_from: the flavor with the user's `model.<key>` overrides. With it, the
    architecture is the source's (config.json or model.json), so nothing needs restating; an override that
    contradicts it is refused naming the key and both values (silently training another architecture on
    those weights is the failure this prevents). A RoPE model's max_seq_len may differ: it sizes the RoPE
    table, no weight. The family must be the source's (any Llama family for an HF Llama directory, which
    does not say which Llama it is; config.load puts the source's in place of a recipe's), and the flavor is
    a label: none of its sizes is built."""
    from ember.models import build_model_args, not_a_hyperparameter

    if not init_from:
        return ModelChoice(family, flavor, build_model_args(family, flavor, overrides))  # also checks the keys
    src_family, src_flavor, src_args, where = source_architecture(init_from)
    same_class = MODELS[family].args_cls is MODELS[src_family].args_cls
    if not same_class or (family != src_family and where.name == MODEL_JSON):
        raise ConfigError(f"model.family={family} but model.init_from {where} describes a {src_family} model; "
                          "drop model.family (the architecture comes from model.init_from)")
    keys = MODELS[family].args_cls.CONFIG_KEYS  # config key -> field, where they differ
    fields = {f.name for f in dataclasses.fields(src_args)} - set(keys.values()) | set(keys)
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ConfigError(not_a_hyperparameter(unknown[0], family, fields))
    for key, value in sorted(overrides.items()):
        if key == "max_seq_len" and src_args.rope is not None:
            continue
        have = getattr(src_args, key)  # a config key: ffn_hidden_dim reads Llama's derived size
        if value != have:
            raise ConfigError(f"model.{key}={value} contradicts model.init_from {where} ({key} {have}); the "
                              f"architecture comes from model.init_from: drop model.{key}")
    field_overrides = {keys.get(k, k): v for k, v in overrides.items() if k == "max_seq_len"}
    args = dataclasses.replace(src_args, **field_overrides)
    return ModelChoice(family, src_flavor, args, str(where))


def load_weights(model: Union[nn.Module, list[nn.Module]], path: Union[str, Path]) -> Path:
    """Load weights into `model` in place, resharded to its layout: an ember checkpoint (a step-N
    directory, or a run directory's newest; DCP reads only the shards this rank needs) or a Hugging Face
    directory (config.json + safetensors). Returns the directory read."""
    path = Path(path)
    if not path.is_dir():
        raise UserFileNotFound(f"model.init_from '{path}' does not exist; give a checkpoints/step-N, run or HF directory")
    if is_peft_dir(path):
        _copy_whole(model, load_model(path), path)
        return path
    if (path / "config.json").is_file() and not (path / MODEL_JSON).is_file():
        load_hf_weights(model, path)
        return path
    step_dir = ember_step_dir(path)
    if step_dir is None:
        raise UserFileNotFound(f"'{path}' is neither an ember checkpoint (no {MODEL_JSON}) nor a run directory")
    if "lora" in read_json(step_dir / MODEL_JSON):  # a LoRA run: its base with the adapters folded in
        source = load_model(step_dir)
        merge_lora(source)
        _copy_whole(model, source, step_dir)
        return step_dir
    state = base_state_dict(model)
    _quiet_dcp(dcp.load, {"model": state}, checkpoint_id=str(step_dir))
    return step_dir


@torch.no_grad()
def _copy_whole(model: Union[nn.Module, list[nn.Module]], source: nn.Module, where: Path) -> None:
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


def _load_ember(step_dir: Path, device: Device, dtype: torch.dtype) -> nn.Module:
    raw = read_json(step_dir / MODEL_JSON)
    family, _, args = parse_model_meta(raw, step_dir / MODEL_JSON)
    if "lora" in raw:  # adapters only: the base they name, with them applied
        return _load_lora_checkpoint(step_dir, raw, device, dtype)
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
        raise CheckpointError(f"'{step_dir}': its weights do not fit its {MODEL_JSON} ({first_error_line(err)})") from None
    return model


# ---- LoRA: adapter-only checkpoints and peft adapter directories (ember/finetune/) ---------------------


def _load_lora_checkpoint(step_dir: Path, meta: dict[str, Any], device: Device, dtype: torch.dtype) -> nn.Module:
    """A LoRA checkpoint: its base (meta["base"], model.init_from of the run) with the saved adapters, unmerged."""
    base = meta.get("base")
    if not isinstance(base, str) or not Path(base).exists():
        raise UserFileNotFound(f"'{step_dir}' holds LoRA adapters for the base '{base}', which is gone; put the base "
                               f"back there (or point \"base\" in its {MODEL_JSON} at it)")
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
        raise CheckpointError(f"'{step_dir}': its adapters do not fit its base '{base}' ({first_error_line(err)})") from None
    return model


def _adapter_tensors(step_dir: Path, meta: dict[str, Any]) -> tuple[Any, dict[str, torch.Tensor], list[str]]:
    """(args, {name: tensor} of a LoRA checkpoint's trainable tensors, the buffers its training moved), read without
    loading the base."""
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
        raise CheckpointError(f"'{step_dir}': its adapters do not fit its {MODEL_JSON} ({first_error_line(err)})") from None
    moved = moved_buffers({name: state["model"].pop(name) for name in buffers if name in state["model"]},
                          state.get(START, {}))
    return args, state["model"], moved


def _peft_base(adapter_dir: Path) -> Path:
    return peft_base(check_adapter_config(read_json(adapter_dir / "adapter_config.json"), adapter_dir), adapter_dir)


def _load_peft(adapter_dir: Path, device: Device, dtype: torch.dtype) -> nn.Module:
    """A peft adapter directory: its base (base_model_name_or_path, local) with the adapter folded in."""
    config = read_json(adapter_dir / "adapter_config.json")
    model = load_model(_peft_base(adapter_dir), device, torch.float32)
    merge_lora(model)  # a base that is itself a LoRA run
    family = family_of(model)
    merge_peft_adapter(model, family, config, adapter_dir)
    model.to(dtype)
    model.init_rope(torch.device(device))  # the RoPE tables stay fp32
    return model


@torch.no_grad()
def load_model(path: Union[str, Path], device: Device = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model stored at `path`, in eval mode: `model(tokens (B, T)) -> logits (B, T, vocab)`.

    `path` is an ember checkpoint (`<run>/checkpoints/step-N`), a run directory (its newest complete
    step), a Hugging Face directory (config.json and safetensors weights), or the torch.save file that
    `ember convert --to torch` writes. Parameters come in `dtype`; the RoPE tables stay fp32.
    """
    path = Path(path)
    expected = MODEL_PATHS
    if not path.exists():
        raise UserFileNotFound(f"'{path}' does not exist (expected {expected})")
    if path.is_file():
        model = _load_torch_file(path).to(device=device, dtype=dtype)
        model.init_rope(torch.device(device))  # the RoPE tables stay fp32
        return model.eval()
    if (path / MODEL_JSON).is_file():
        model = _load_ember(path, device, dtype)
    elif (path / "checkpoints").is_dir():
        model = _load_ember(newest_step_dir(path), device, dtype)
    elif is_peft_dir(path):
        model = _load_peft(path, device, dtype)
    elif (path / "config.json").is_file():
        model = load_hf_model(path, device, dtype)
    else:
        raise UserFileNotFound(f"'{path}' holds no model (expected {expected})")
    return model.eval()


def _load_torch_file(path: Path) -> nn.Module:
    if not zipfile.is_zipfile(path):  # torch.save's format; else torch's own message is about mmap
        raise CheckpointError(f"'{path}' is not a model: a model path is {MODEL_PATHS}")
    try:  # weights_only: a checkpoint file is data; mmap: the tensors stay on disk until copied
        payload = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    except Exception as err:
        raise CheckpointError(f"'{path}' is not a torch.save file ember can read safely ({first_error_line(err)})") from None
    if not isinstance(payload, dict) or "model" not in payload or "ember" not in payload:
        raise CheckpointError(f"'{path}' holds no {{'model': state_dict, 'ember': model.json}}; write it with ember convert")
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
