"""`load_model(path)`: an ember run or checkpoint directory, or a Hugging Face model directory.

Weights are read only through safetensors (HF) or torch.distributed.checkpoint (ember), never by
unpickling a file someone handed us, and no remote code runs. Models are built on the meta device and
filled once, so a large model never sits in memory twice.

An ember checkpoint is `<run>/checkpoints/step-N/`: the DCP files of {"model": model.state_dict()} plus
model.json = {"family", "flavor", "args"}, enough to rebuild the model without the recipe.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from ember.models import MODELS

MODEL_JSON = "model.json"
HF_FAMILY = "llama3"  # Llama 2 and 3.x share one architecture; config.json carries the differences
Device = Union[str, torch.device]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"'{path}' is not readable JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"'{path}' does not hold a JSON object")
    return data


def _on_meta(family: str, args: Any, dtype: torch.dtype) -> nn.Module:
    with torch.device("meta"):
        return MODELS[family].model_cls(args).to(dtype)  # costs nothing: no storage on meta


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


def load_weights(model: Union[nn.Module, list[nn.Module]], path: Union[str, Path]) -> Path:
    """Load an ember checkpoint's weights (a step-N directory, or a run directory's newest) into `model`,
    in place and resharded to its layout (DCP reads only the shards this rank needs). Returns the step dir."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint '{path}' does not exist; give a checkpoints/step-N or run directory")
    step_dir = path if (path / MODEL_JSON).is_file() else _newest_step_dir(path) if (path / "checkpoints").is_dir() else None
    if step_dir is None:
        raise FileNotFoundError(f"'{path}' is neither an ember checkpoint (no {MODEL_JSON}) nor a run directory")
    state = model_state_dict(model)
    _quiet_dcp(dcp.load, {"model": state}, checkpoint_id=str(step_dir))
    return step_dir


def save_ember_checkpoint(model: Union[nn.Module, list[nn.Module]], family: str, flavor: str, args: Any,
                          step_dir: Union[str, Path]) -> None:
    """Write model weights (DCP) and model.json to step_dir, via `step_dir.tmp` and a rename, so a
    directory named step-N is always complete. Collective when torch.distributed is initialised;
    `model` may be a list of pipeline stages."""
    step_dir = Path(step_dir)
    tmp = step_dir.with_name(step_dir.name + ".tmp")
    if _is_rank0():
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier save
    _barrier()
    _quiet_dcp(dcp.save, {"model": model_state_dict(model)}, checkpoint_id=str(tmp))
    if _is_rank0():  # DCP returns once every rank's shards and the metadata are written
        meta = {"family": family, "flavor": flavor, "args": dataclasses.asdict(args)}
        (tmp / MODEL_JSON).write_text(json.dumps(meta, indent=2) + "\n")
        if step_dir.exists():
            shutil.rmtree(step_dir)
        os.replace(tmp, step_dir)
    _barrier()


def _newest_step_dir(run_dir: Path) -> Path:
    steps = [(int(m.group(1)), p) for p in (run_dir / "checkpoints").iterdir()
             if (m := re.fullmatch(r"step-(\d+)", p.name)) and (p / MODEL_JSON).is_file()]
    if not steps:
        raise FileNotFoundError(f"'{run_dir / 'checkpoints'}' holds no complete checkpoint (expected step-N/{MODEL_JSON})")
    return max(steps)[1]


def _load_ember(step_dir: Path, device: Device, dtype: torch.dtype) -> nn.Module:
    meta = _read_json(step_dir / MODEL_JSON)
    family = meta.get("family")
    if family not in MODELS:
        raise ValueError(f"'{step_dir / MODEL_JSON}' names model family '{family}' (known: {', '.join(MODELS)})")
    try:
        args = MODELS[family].args_cls(**meta["args"])
    except (KeyError, TypeError) as err:
        raise ValueError(f"'{step_dir / MODEL_JSON}' has no valid 'args' for {family} ({err})") from None
    model = _on_meta(family, args, dtype)
    model.to_empty(device=device)
    model.tie_weights()
    model.init_rope()
    state = {"model": model.state_dict()}
    # In place into the model's own tensors; DCP reads tensors with weights_only unpickling and
    # converts to the model's dtype as it copies.
    _quiet_dcp(dcp.load, state, checkpoint_id=str(step_dir))
    return model


# ---- Hugging Face directories (safetensors) ---------------------------------------------------------


def _hf_weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"'{index}' has no 'weight_map'")
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"'{missing[0]}' is missing (listed in '{index}')")
        return files
    if (directory / "model.safetensors").is_file():
        return [directory / "model.safetensors"]
    pickles = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt*"))
    hint = f"; found {pickles[0]}, which ember does not unpickle: convert it to safetensors" if pickles else ""
    raise FileNotFoundError(f"'{directory}' has no model.safetensors or model.safetensors.index.json{hint}")


def _load_hf(directory: Path, device: Device, dtype: torch.dtype) -> nn.Module:
    from safetensors import safe_open

    config_path = directory / "config.json"
    config = _read_json(config_path)
    architectures = config.get("architectures") or ["LlamaForCausalLM"]
    if config.get("model_type") != "llama" or architectures != ["LlamaForCausalLM"]:
        raise ValueError(f"'{config_path}' describes model_type '{config.get('model_type')}' / architectures "
                         f"{architectures}; ember loads only LlamaForCausalLM ('llama') models")
    hf = MODELS[HF_FAMILY].hf
    try:
        args = hf.args_from_hf_config(config)
    except (KeyError, ValueError) as err:
        raise ValueError(f"'{config_path}': {err}") from None
    state = {}
    for path in _hf_weight_files(directory):  # tensor by tensor: only the target copy stays in memory
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                if hf.skip_hf_key(key, args):
                    continue
                try:
                    ember_key = hf.from_hf_key(key)
                except KeyError as err:
                    raise ValueError(f"'{path}': {err.args[0]}") from None
                state[ember_key] = hf.tensor_from_hf(ember_key, f.get_tensor(key), args).to(device, dtype)
    if args.tie_embeddings and "tok_embeddings.weight" in state:
        state["output.weight"] = state["tok_embeddings.weight"]
    model = _on_meta(HF_FAMILY, args, dtype)
    try:  # assign: the loaded tensors become the parameters, so the meta model needs no to_empty
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as err:
        detail = " ".join(str(err).split())
        raise ValueError(f"'{directory}': the weights do not fit config.json: {detail}") from None
    model.tie_weights()
    model.init_rope(torch.device(device))
    return model


@torch.no_grad()
def load_model(path: Union[str, Path], device: Device = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model stored at `path`, in eval mode: `model(tokens (B, T)) -> logits (B, T, vocab)`.

    `path` is an ember checkpoint (`<run>/checkpoints/step-N`), a run directory (its newest complete
    step), or a Hugging Face LlamaForCausalLM directory (config.json and safetensors weights).
    Parameters come in `dtype`; the RoPE tables stay fp32.
    """
    path = Path(path)
    expected = f"an ember run or checkpoint directory ({MODEL_JSON}, checkpoints/step-N) or a HF model directory (config.json)"
    if not path.exists():
        raise FileNotFoundError(f"'{path}' does not exist (expected {expected})")
    if not path.is_dir():
        raise ValueError(f"'{path}' is a file (expected {expected})")
    if (path / MODEL_JSON).is_file():
        model = _load_ember(path, device, dtype)
    elif (path / "checkpoints").is_dir():
        model = _load_ember(_newest_step_dir(path), device, dtype)
    elif (path / "config.json").is_file():
        model = _load_hf(path, device, dtype)
    else:
        raise FileNotFoundError(f"'{path}' holds no model (expected {expected})")
    return model.eval()
