"""What an export to a Hugging Face directory carries beside the weights and the architecture: config.json's special
token ids, generation_config.json, and the config fields no ember hyper-parameter holds (router_aux_loss_coef).
Without the ids transformers' generate on an export would not stop at the model's EOS.

Where they come from: a Hugging Face source's own config.json (a multimodal one's text_config first, then its top
level) and generation_config.json, as they were; an ember checkpoint converted from one keeps both beside its
weights (SOURCE_CONFIG, generation_config.json) for a later export; any other model (an ember run) gets the ids of
the tokenizer written beside the export.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Optional

from ember.finetune.peft_format import check_adapter_config, is_peft_dir, peft_base
from ember.model_io.model_meta import MODEL_JSON, ember_step_dir, read_json

# config.json fields an export carries from its source; an ember run's export writes the ids only
CARRIED_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "router_aux_loss_coef")
SOURCE_CONFIG = "hf_config.json"  # beside an ember checkpoint: the config.json of the HF directory it came from
GENERATION_CONFIG = "generation_config.json"


def _hf_source(path: Path) -> Optional[tuple[Path, Optional[Path]]]:
    """(the HF config.json a model at `path` was read or converted from, its generation_config.json if any); None
    for a model from no HF directory (an ember run, a torch file). A peft adapter's is its base's."""
    if path.is_file():
        return None
    if is_peft_dir(path):
        return _hf_source(peft_base(check_adapter_config(read_json(path / "adapter_config.json"), path), path))
    step_dir = ember_step_dir(path)
    if step_dir is None and not (path / MODEL_JSON).is_file():
        config, folder = path / "config.json", path
    else:
        folder = step_dir or path
        config = folder / SOURCE_CONFIG
    if not config.is_file():
        return None
    generation = folder / GENERATION_CONFIG
    return config, generation if generation.is_file() else None


def keep_hf_source(src: Path, checkpoint: Path) -> None:
    """Beside an ember checkpoint converted from `src`: the HF config.json (as SOURCE_CONFIG) and generation_config.json
    that `src` came from, when it came from an HF directory, so that exporting the checkpoint carries them."""
    found = _hf_source(src)
    if found is None:
        return
    config, generation = found
    shutil.copyfile(config, checkpoint / SOURCE_CONFIG)
    if generation is not None:
        shutil.copyfile(generation, checkpoint / GENERATION_CONFIG)


def carry_into_export(src: Path, export: Path) -> None:
    """Complete the HF directory `export` (save_hf's config.json, and the tokenizer beside it) written from `src`: the
    source's carried fields, or the tokenizer's ids, into config.json; the source's generation_config.json as it was,
    or one naming the tokenizer's ids."""
    config = read_json(export / "config.json")
    found = _hf_source(src)
    generation: Optional[dict[str, Any]] = None
    if found is not None:
        source_config, source_generation = found
        stated = _stated(read_json(source_config))
        for key in CARRIED_KEYS:
            if key in stated:
                config[key] = stated[key]
            else:
                config.pop(key, None)  # the source relied on its class's default, and so does the export
        if source_generation is not None:
            shutil.copyfile(source_generation, export / GENERATION_CONFIG)
    else:
        ids = tokenizer_ids(export)
        if ids is None:
            return
        config.update(ids)
        generation = {"_from_model_config": True, **{k: v for k, v in ids.items() if v is not None}}
    (export / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if generation is not None:
        (export / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")


def _stated(source: dict[str, Any]) -> dict[str, Any]:
    """The carried fields a source config.json states: a multimodal one's text_config first (the export is its text
    model), then its top level (the hub's Gemma 3 names its EOS list there)."""
    text = source.get("text_config") if isinstance(source.get("text_config"), dict) else {}
    return {key: text[key] if key in text else source[key] for key in CARRIED_KEYS if key in text or key in source}


def tokenizer_ids(folder: Path) -> Optional[dict[str, Optional[int]]]:
    """config.json's bos/eos/pad_token_id for the tokenizer in `folder`; None where it holds none. A BOS only found
    among the usual names (never declared, so never inserted) and a padding that is only the EOS stand-in are None."""
    from ember.data.tokenizer import load_tokenizer

    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        return None
    tokenizer = load_tokenizer(str(folder))
    declared_bos = getattr(tokenizer, "bos_declared", tokenizer.bos_id is not None)
    return {"bos_token_id": tokenizer.bos_id if declared_bos else None, "eos_token_id": tokenizer.eos_id,
            "pad_token_id": tokenizer.pad_id if tokenizer.pad_id != tokenizer.eos_id else None}
