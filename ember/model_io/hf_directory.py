"""A Hugging Face model directory (config.json and safetensors weights): which ember family its config.json
describes, its weight files, and the whole model read from them.

Weights are read only through safetensors, never by unpickling, and no remote code runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch
from torch import nn

from ember.errors import CheckpointError, UserFileNotFound, first_error_line
from ember.model_io.model_meta import build_on_meta, read_json
from ember.models import MODELS

HF_FAMILY = "llama3"  # Llama 2 and 3.x share one architecture; config.json carries the differences
Device = Union[str, torch.device]


def hf_weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a directory: those its model.safetensors.index.json lists, or its one
    model.safetensors; a directory with only pickled weights (.bin, .pt) is refused, naming the fix."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"'{index}' has no 'weight_map'")
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise UserFileNotFound(f"'{missing[0]}' is missing (listed in '{index}')")
        return files
    if (directory / "model.safetensors").is_file():
        return [directory / "model.safetensors"]
    pickles = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt*"))
    hint = f"; found {pickles[0]}, which ember does not unpickle: convert it to safetensors" if pickles else ""
    raise UserFileNotFound(f"'{directory}' has no model.safetensors or model.safetensors.index.json{hint}")


@contextlib.contextmanager
def open_safetensors(path: Path) -> Iterator[Any]:
    """safe_open(path) on the CPU; a damaged file (truncated, or another format written over it) is a one-line
    error naming it, whether its header or a tensor is what cannot be read."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            yield f
    except SafetensorError as err:
        raise _damaged(path, err) from None


def _damaged(path: Path, err: Exception) -> CheckpointError:
    return CheckpointError(f"'{path}' is not a readable safetensors file ({first_error_line(err)}): it is damaged "
                           "or another format was written over it; export or copy it again")


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """One tensor of a directory's weight files, not read yet: `read()` reads it (while hf_tensors is at it)."""

    file: Path
    name: str  # as the text model names it (a multimodal checkpoint's `language_model.` prefix dropped)
    shape: tuple[int, ...]
    _handle: Any
    _key: str

    def read(self) -> torch.Tensor:
        from safetensors import SafetensorError

        try:
            return self._handle.get_tensor(self._key)
        except SafetensorError as err:  # raised here, in the reader's frame, not inside open_safetensors
            raise _damaged(self.file, err) from None


def hf_tensors(directory: Path) -> Iterator[StoredTensor]:
    """Every weight of a directory's text model, file by file, each read only when asked (a pipeline stage reads
    its own); a multimodal checkpoint's vision tower and projector are left out."""
    multimodal = read_json(directory / "config.json").get("model_type") in TEXT_MODEL_TYPES
    for path in hf_weight_files(directory):
        with open_safetensors(path) as f:
            for key in f.keys():
                name = text_weight_name(key) if multimodal else key
                if name is not None:
                    yield StoredTensor(path, name, tuple(f.get_slice(key).get_shape()), f, key)


# config.json model_type -> (ember family, the one architecture ember loads for it)
HF_FAMILIES = {"llama": (HF_FAMILY, "LlamaForCausalLM"), "mixtral": ("mixtral", "MixtralForCausalLM"),
               "gpt2": ("gpt", "GPT2LMHeadModel"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
               "qwen3": ("qwen3", "Qwen3ForCausalLM"), "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
               "mistral": ("mistral", "MistralForCausalLM"), "phi3": ("phi3", "Phi3ForCausalLM"),
               "gemma3_text": ("gemma3", "Gemma3ForCausalLM"), "gemma2": ("gemma2", "Gemma2ForCausalLM"),
               "deepseek_v3": ("deepseek_v3", "DeepseekV3ForCausalLM"),
               "deepseek_v2": ("deepseek_v2", "DeepseekV2ForCausalLM"),
               "llama4_text": ("llama4", "Llama4ForCausalLM"),
               # multimodal (the hub's Llama 4 Scout and Maverick, Gemma 3 4B-27B): ember reads their text model
               "llama4": ("llama4", "Llama4ForConditionalGeneration"),
               "gemma3": ("gemma3", "Gemma3ForConditionalGeneration")}
# a multimodal model_type -> its text model's: the hyper-parameters are config.json's text_config, the weights those
# under `language_model.` (the hub's files; transformers 5 names them `model.language_model.` in memory)
TEXT_MODEL_TYPES = {"llama4": "llama4_text", "gemma3": "gemma3_text"}
_TEXT_PREFIXES = {"language_model.": "", "model.language_model.": "model."}
_OTHER_TOWERS = tuple(f"{scope}{tower}." for scope in ("", "model.")
                      for tower in ("vision_tower", "vision_model", "multi_modal_projector"))


def text_weight_name(key: str) -> Optional[str]:
    """A multimodal checkpoint's weight name as its text model names it (`language_model.model.layers.0...` and
    `model.language_model.layers.0...` are `model.layers.0...`); None for the vision tower's and projector's."""
    if key.startswith(_OTHER_TOWERS):
        return None
    for prefix, replacement in _TEXT_PREFIXES.items():
        if key.startswith(prefix):
            return replacement + key.removeprefix(prefix)
    return key  # lm_head.weight, as transformers 5 names it


def text_config(config: dict[str, Any], where: Path) -> dict[str, Any]:
    """The text model's config: config.json itself, or a multimodal one's text_config (with its model_type)."""
    model_type = config.get("model_type")
    if model_type not in TEXT_MODEL_TYPES:
        return config
    if not isinstance(config.get("text_config"), dict):
        raise CheckpointError(f"'{where}' describes a multimodal {model_type} model without text_config, where ember "
                              "reads its text model's hyper-parameters; restore text_config from the original")
    return {**config["text_config"], "model_type": TEXT_MODEL_TYPES[model_type]}


def hf_family(directory: Path) -> tuple[str, dict[str, Any]]:
    """(the ember family, the parsed config.json: a multimodal model's text_config) of a directory whose
    config.json describes a model ember loads; any other model_type or architecture is refused, naming what
    ember loads."""
    config_path = directory / "config.json"
    config = read_json(config_path)
    model_type = config.get("model_type")
    if model_type not in HF_FAMILIES:
        raise CheckpointError(f"'{config_path}' describes model_type '{model_type}'; ember loads "
                              f"{', '.join(HF_FAMILIES)} ({', '.join(a for _, a in HF_FAMILIES.values())}) models")
    family, expected = HF_FAMILIES[model_type]
    architectures = config.get("architectures") or [expected]
    if architectures != [expected]:
        raise CheckpointError(f"'{config_path}' describes architectures {architectures}; ember loads {expected} "
                              f"for model_type '{model_type}'")
    return family, text_config(config, config_path)


def load_hf_model(directory: Path, device: Device, dtype: torch.dtype) -> nn.Module:
    """The whole model of a directory, its parameters in `dtype` on `device` (the RoPE tables fp32), built on
    the meta device and filled with the loaded tensors, so it never sits in memory twice."""
    family, config = hf_family(directory)
    hf = MODELS[family].hf
    try:
        args = hf.args_from_hf_config(config)
    except (KeyError, ValueError) as err:
        raise CheckpointError(f"'{directory / 'config.json'}': {err}") from None
    # tensor by tensor, straight to the target device and dtype
    hf_state = {stored.name: stored.read().to(device, dtype) for stored in hf_tensors(directory)}
    try:
        state = hf.from_hf_state_dict(hf_state, args)
    except KeyError as err:
        raise CheckpointError(f"'{directory}': {err.args[0]}") from None
    del hf_state
    model = build_on_meta(family, args, dtype)
    try:  # assign: the loaded tensors become the parameters, so the meta model needs no to_empty
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as err:
        detail = " ".join(str(err).split())
        raise CheckpointError(f"'{directory}': the weights do not fit config.json: {detail}") from None
    model.tie_weights()
    model.init_rope(torch.device(device))
    return model
