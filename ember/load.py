"""`load_model(path)`: an ember run or checkpoint directory, or a Hugging Face model directory.

Weights are read only through safetensors (HF) or torch.distributed.checkpoint (ember): nothing that
is loaded can execute code. Models are built on the meta device and materialised once, so a large
model never sits in memory twice.
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
from torch import nn

from ember.models import MODELS

MODEL_JSON = "model.json"  # family, flavor and hyper-parameters, beside the DCP files of a checkpoint


def _build(family: str, args: Any, device: Union[str, torch.device], dtype: torch.dtype) -> nn.Module:
    with torch.device("meta"):
        model = MODELS[family].model_cls(args)
    model.to_empty(device=device)
    model.init_weights()  # rope buffers; the weights are overwritten by the checkpoint
    return _cast_params(model, dtype)


def _cast_params(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    # Parameters only: Module.to(dtype) would also cast the complex RoPE buffer to real.
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model


def _newest_step_dir(run_dir: Path) -> Path:
    steps = [(int(m.group(1)), p) for p in (run_dir / "checkpoints").glob("step-*")
             if (m := re.fullmatch(r"step-(\d+)", p.name)) and (p / MODEL_JSON).is_file()]
    if not steps:
        raise FileNotFoundError(f"no complete checkpoint under '{run_dir / 'checkpoints'}' (expected step-N/{MODEL_JSON})")
    return max(steps)[1]


def save_ember_checkpoint(model: nn.Module, family: str, flavor: str, args: Any, step_dir: Path) -> None:
    """Model weights with DCP plus model.json; written under a temporary name, then renamed (atomic)."""
    import torch.distributed.checkpoint as dcp

    step_dir = Path(step_dir)
    tmp = step_dir.with_name(step_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with warnings.catch_warnings():  # "no process group: saving in a single process" is the intent here
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp))
    meta = {"family": family, "flavor": flavor, "args": dataclasses.asdict(args)}
    (tmp / MODEL_JSON).write_text(json.dumps(meta, indent=2) + "\n")
    if step_dir.exists():
        shutil.rmtree(step_dir)
    os.replace(tmp, step_dir)


def _load_ember(step_dir: Path, device, dtype) -> nn.Module:
    import torch.distributed.checkpoint as dcp

    meta = json.loads((step_dir / MODEL_JSON).read_text())
    family = meta.get("family")
    if family not in MODELS:
        raise ValueError(f"'{step_dir / MODEL_JSON}' names unknown model family '{family}'")
    args = type(MODELS[family].flavors[next(iter(MODELS[family].flavors))])(**meta["args"])
    model = _build(family, args, device, torch.float32)
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(step_dir))
    model.load_state_dict(state["model"])
    return _cast_params(model, dtype)


def _hf_weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [directory / name for name in names]
    else:
        files = sorted(directory.glob("*.safetensors"))
    missing = [f for f in files if not f.is_file()]
    if not files or missing:
        what = f"'{missing[0]}' is missing" if missing else "no *.safetensors files"
        raise FileNotFoundError(f"Hugging Face directory '{directory}': {what} (only safetensors weights are loaded)")
    return files


def _load_hf(directory: Path, device, dtype) -> nn.Module:
    from safetensors import safe_open

    config = json.loads((directory / "config.json").read_text())
    model_type = config.get("model_type")
    family = "llama3"  # Llama 2 and 3 differ only in config values, which args_from_hf_config reads
    if model_type != "llama":
        raise ValueError(f"'{directory / 'config.json'}' has model_type '{model_type}'; ember loads 'llama' models")
    hf = MODELS[family].hf
    args = hf.args_from_hf_config(config)
    model = _build(family, args, device, torch.float32)
    targets = model.state_dict()
    loaded = set()
    # Tensor by tensor, straight into the model's storage: peak memory is one model plus one tensor.
    for path in _hf_weight_files(directory):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                if key.endswith("rotary_emb.inv_freq"):
                    continue
                if args.tie_embeddings and key == "lm_head.weight":
                    continue
                ember_key = hf.from_hf_key(key)
                tensor = hf.convert_tensor_from_hf(ember_key, f.get_tensor(key), args)
                if targets[ember_key].shape != tensor.shape:
                    raise ValueError(f"'{path}': {key} has shape {tuple(tensor.shape)}, the config implies "
                                     f"{tuple(targets[ember_key].shape)}")
                targets[ember_key].copy_(tensor)
                loaded.add(ember_key)
    expected = {k for k in targets if not (args.tie_embeddings and k == "output.weight")}
    if expected - loaded:
        raise ValueError(f"'{directory}' lacks weights for {sorted(expected - loaded)[:3]} (incomplete checkpoint?)")
    return _cast_params(model, dtype)


@torch.no_grad()
def load_model(path: Union[str, Path], device: Union[str, torch.device] = "cpu",
               dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model in `path`, in eval mode: `model(tokens) -> logits` of shape (batch, seq, vocab)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"'{path}' is not a directory (expected an ember run/checkpoint or a HF model directory)")
    if (path / MODEL_JSON).is_file():
        model = _load_ember(path, device, dtype)
    elif (path / "checkpoints").is_dir():
        model = _load_ember(_newest_step_dir(path), device, dtype)
    elif (path / "config.json").is_file():
        model = _load_hf(path, device, dtype)
    else:
        raise FileNotFoundError(
            f"'{path}' holds neither an ember checkpoint ({MODEL_JSON}, checkpoints/step-N) nor a HF model (config.json)"
        )
    return model.eval()
