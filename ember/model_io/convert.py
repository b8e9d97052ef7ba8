"""Writing models and converting between formats (`ember convert`): Hugging Face directories (safetensors),
ember DCP checkpoints, torch.save files, peft adapter directories; the tokenizer beside an HF export.
Reading is ember/model_io/load.py's; this module depends on it, never the reverse.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import zipfile
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from ember.errors import CheckpointError, UserFileNotFound, first_error_line
from ember.finetune.base_fingerprint import check_lora_base, model_files
from ember.finetune.lora import merge_lora
from ember.finetune.peft_format import is_peft_dir, save_peft, save_safetensors
from ember.finetune.sources import adapter_tensors
from ember.model_io.hf_export import carry_into_export, keep_hf_source
from ember.model_io.load import _barrier, _is_rank0, _load_torch_file, _quiet_dcp, load_model, model_state_dict
from ember.model_io.model_meta import MODEL_JSON, ember_step_dir, read_json, read_model_json
from ember.models import MODELS, family_of
from ember.storage.cache import local_copy
from ember.storage.location import Location, as_path, canonical, is_url
from ember.storage.staging import staged_at

# What makes a written directory a model to its readers (ember, HF, peft): moved last onto a store (staging.upload).
MARKERS = (MODEL_JSON, "config.json", "adapter_config.json")


def save_hf(model: nn.Module, args: Any, out_dir: Union[str, Path], max_shard_bytes: int = 5 * 2**30) -> None:
    """Write `model` as a Hugging Face LlamaForCausalLM directory: config.json and safetensors shards
    (with an index when there is more than one), converting tensor by tensor."""
    hf = MODELS[family_of(model)].hf
    out_dir = Path(out_dir)
    try:
        config = hf.hf_config_from_args(args)
    except ValueError as err:  # a family (GLaM) or an option the HF format cannot express
        raise CheckpointError(f"cannot write a Hugging Face directory: {first_error_line(err)}") from None
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    # to_hf_state_dict renames and permutes; the permuted q/k rows are the only copies made.
    for hf_key, hf_tensor in hf.to_hf_state_dict({k: t.detach() for k, t in model.state_dict().items()}, args).items():
        hf_tensor = hf_tensor.contiguous()
        nbytes = hf_tensor.numel() * hf_tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][hf_key] = hf_tensor
        size += nbytes
    if len(shards) == 1:
        save_safetensors(shards[0], out_dir / "model.safetensors")
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors(shard, out_dir / name)
        weight_map.update({k: name for k in shard})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for s in shards for t in s.values())},
             "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


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


def detect_format(path: Path) -> str:
    """'hf' (config.json + safetensors), 'ember' (a DCP checkpoint or run directory) or 'torch' (a file)."""
    if path.is_file():
        return "torch"
    if (path / MODEL_JSON).is_file() or (path / "checkpoints").is_dir():
        return "ember"
    if is_peft_dir(path):
        return "peft"
    if (path / "config.json").is_file():
        return "hf"
    raise UserFileNotFound(f"'{path}' is not a Hugging Face directory, an ember checkpoint or a torch.save file")


def _meta_of(model: nn.Module, flavor: str = "custom") -> dict[str, Any]:
    return {"family": family_of(model), "flavor": flavor, "args": dataclasses.asdict(model.args)}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model")


def export_tokenizer(src: Path, dst: Path, vocab_size: int) -> bool:
    """Put the model's tokenizer beside its HF or ember export, so `AutoTokenizer.from_pretrained(dst)`,
    `model.init_from=dst`, `ember eval` and `ember generate` (tokenizer_for) find it: the files of the folder it
    came from (an HF directory's own, or the run's data.tokenizer), or ember's embedded BPE (a run without
    data.tokenizer) saved as tokenizer.json with its EOS named. False when no tokenizer is known (a torch file
    without its run)."""
    import yaml

    from ember.data.tokenizer import embedded_tokenizer

    if (src / "tokenizer.json").is_file() or (src / "tokenizer.model").is_file():
        folder: Optional[Path] = src
    else:
        run = src if (src / "config.yaml").is_file() else src.parent.parent  # a run, or its checkpoints/step-N
        if not (run / "config.yaml").is_file():
            return False
        data = (yaml.safe_load((run / "config.yaml").read_text()) or {}).get("data") or {}
        spec = Path(data["tokenizer"]).expanduser() if data.get("tokenizer") else None
        folder = None if spec is None else spec if spec.is_dir() else spec.parent
        if folder is None:
            tokenizer = embedded_tokenizer(vocab_size, data.get("val_fraction", 0.02))
            tokenizer.tok.save(str(dst / "tokenizer.json"))
            config = {"tokenizer_class": "PreTrainedTokenizerFast",
                      "eos_token": tokenizer.tok.id_to_token(tokenizer.eos_id)}
            (dst / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
            return True
    copied = [name for name in TOKENIZER_FILES if (folder / name).is_file()]
    for name in copied:
        shutil.copyfile(folder / name, dst / name)
    return bool(copied)


def convert(src: Union[str, Path], dst: Union[str, Path], to: Optional[str] = None, merge: bool = False,
            overwrite: bool = False) -> str:
    """Convert a model between a Hugging Face directory, an ember checkpoint and a torch.save file; a LoRA
    run's adapters to a peft directory (`to="peft"`), or folded into its base (`merge`, and always for the
    whole-model formats: ember too, as a plain checkpoint). A peft directory reads as its base with the adapter
    folded in; `merge` of a whole model is refused. The model's tokenizer goes beside an hf or ember output.
    `dst` must be new or empty unless `overwrite` (see check_destination); it is written beside it and swapped
    in whole, so a failed conversion leaves it as it was. Returns the target format. The model is held in memory
    once; formats convert tensor by tensor. Either may be a URL: `src` is read through its local copy
    (ember/storage/cache.py), `dst` written locally and uploaded (ember/storage/staging.py's staged_at)."""
    given = str(src)
    dst = as_path(str(dst))
    if not isinstance(dst, Path):  # what the store holds there, said before a remote source is downloaded
        check_store_destination(given, dst, overwrite, to)
    src = local_copy(src, "SRC")
    source = detect_format(src) if src.exists() else None
    if source is None:
        raise UserFileNotFound(f"'{src}' does not exist")
    target = to or ("hf" if merge else {"hf": "ember", "ember": "hf", "torch": "ember", "peft": "hf"}[source])
    if target not in ("hf", "ember", "torch", "peft"):
        raise CheckpointError(f"--to {target}: choose hf, ember, torch or peft")
    step_dir = ember_step_dir(src) if source == "ember" else None
    meta = read_json(step_dir / MODEL_JSON) if step_dir is not None else {}
    lora_run = "lora" in meta
    if merge and not (lora_run or source == "peft"):  # a whole model already: --merge would mean nothing
        raise CheckpointError(f"--merge folds a LoRA run's or a peft adapter's adapters into the base; '{src}' is "
                              f"{_WHOLE_MODEL[source]}, with none to fold: drop --merge")
    if source == target and not lora_run:  # a LoRA run to ember: its merged model, a plain checkpoint
        raise CheckpointError(f"'{src}' is already in {target} format")
    if isinstance(dst, Path):
        check_destination(src, dst, overwrite, target)
    else:
        check_store_destination(given, dst, overwrite, target)
    if target == "peft":
        if merge or not lora_run:
            raise CheckpointError(f"--to peft writes a LoRA run's adapters; '{src}' is not one (trained without "
                                  "lora.rank)" if not merge
                                  else "--merge folds the adapters into the base: use --to hf")
        check_lora_base(step_dir, meta)  # the adapter names that base: on other weights it would mean another model
        args, state, moved = adapter_tensors(step_dir, meta)
        if moved:
            more = f" (and {len(moved) - 1} more)" if len(moved) > 1 else ""
            raise CheckpointError(f"'{src}': training moved {moved[0]}{more}, a buffer a peft adapter cannot hold (it "
                                  "holds lora_A and lora_B only); export the run merged into its base with --merge, or "
                                  "train with those buffers frozen (model.bias_update_rate=0 for score biases)")
        with staged_at(dst, "convert", markers=MARKERS) as stage:
            save_peft(meta, args, state, stage)
        return target
    if source == "torch":
        model = _load_torch_file(src)
        meta = _meta_of(model)
    else:
        model = load_model(src)
        meta = _meta_of(model)
        if step_dir is not None:  # keep the checkpoint's own family (llama3.1, not the class's) and flavor labels
            family, flavor, _ = read_model_json(step_dir / MODEL_JSON)
            meta.update(family=family, flavor=flavor)
        merge_lora(model)  # a LoRA run as a whole model: W + alpha/r B A
    with staged_at(dst, "convert", markers=MARKERS) as stage:
        if target == "hf":
            save_hf(model, model.args, stage)
        elif target == "torch":
            torch.save({"model": model.state_dict(), "ember": meta}, stage)
        else:
            save_ember_checkpoint(model, meta["family"], meta["flavor"], model.args, stage)
        if target != "torch" and source != "torch":  # a torch file holds no tokenizer, nor knows its run
            export_tokenizer(src, stage, model.args.vocab_size)
            # the token ids and generation_config.json: an HF source's (kept beside an ember checkpoint for a later
            # export), else the tokenizer's
            if target == "hf":
                carry_into_export(src, stage)
            else:
                keep_hf_source(src, stage)
    return target


_DIRECTORY_NAMES = {"hf": "Hugging Face directory", "ember": "ember checkpoint", "peft": "peft adapter directory"}
_WHOLE_MODEL = {"hf": "a Hugging Face directory", "torch": "a torch.save file",
                "ember": "an ember checkpoint of a whole model (trained without lora.rank)"}


def _check_creatable(dst: Path) -> None:
    """A new `dst` (and the staging folder beside it) can be made: its nearest existing ancestor is a writable
    directory."""
    existing = dst.parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise CheckpointError(f"'{dst}' cannot be created: '{existing}' is a file; give another destination")
    probe = existing / f".ember-convert-probe-{os.getpid()}"
    try:  # a real attempt: os.access says yes to root, and to filesystems such as /proc that refuse every write
        probe.mkdir()
        probe.rmdir()
    except OSError as err:
        raise CheckpointError(f"'{dst}' cannot be created in '{existing}' ({err.strerror}); give another "
                              "destination") from None


def check_destination(src: Path, dst: Path, overwrite: bool, to: str) -> None:
    """`ember convert` writes into a new or empty `dst`; over anything else only with --overwrite, and never over
    what the conversion reads (the source, or a LoRA run's or peft adapter's base): that would destroy the
    model being converted, or leave the run it came from on other weights. `--to torch` writes one file, the
    other formats a directory: a destination of the other kind is refused, and an existing file is replaced only
    when it is an earlier `--to torch` export (not, say, the weights file of an HF directory, which that would
    break)."""
    writes_file = to == "torch"
    if dst.exists() and dst.is_dir() == writes_file:
        kind, writes = ("a directory", "one file") if writes_file else ("a file", "a directory")
        example = f" such as '{dst / 'model.pt'}'" if writes_file else ""
        raise CheckpointError(f"'{dst}' is {kind}, but --to {to} writes {writes}: give a new path{example}")
    if not dst.exists():
        _check_creatable(dst)
        return
    if dst.is_dir() and not any(dst.iterdir()):
        return
    if not overwrite:
        if writes_file:
            raise CheckpointError(f"'{dst}' exists; give --overwrite to replace it, or write to a new file")
        raise CheckpointError(f"'{dst}' is not empty; give --overwrite to replace what it holds, or write to a new "
                              "directory")
    if writes_file and not _is_torch_export(dst):
        try:
            part_of = f" (it is part of the {_DIRECTORY_NAMES[detect_format(dst.parent)]} '{dst.parent}')"
        except UserFileNotFound:
            part_of = ""
        raise CheckpointError(f"'{dst}' is not a file `ember convert --to torch` wrote{part_of}; --overwrite replaces "
                              "only such a file: write to a new file")
    target = dst.resolve()
    for read in _files_read(src):
        if read == target or target in read.parents:
            model = read if read == target else read.parent  # a torch file, or the directory of a model's files
            raise CheckpointError(f"'{dst}' holds {model}, which converting '{src}' reads; --overwrite would destroy "
                                  "it: write to another directory")


def check_store_destination(src: str, dst: Location, overwrite: bool, to: Optional[str]) -> None:
    """check_destination's rules for a destination on an object store, where a directory is a prefix (none when
    nothing is under it): anything there replaced only with --overwrite, and never when it holds the source (`src`
    a URL at or under it). With the target format known (`to`): a file for --to torch, a prefix for the others,
    and an existing file replaced only when it is an earlier --to torch export."""
    fs, path = dst.fs, dst.path.rstrip("/")
    held = fs.find(path)
    if not held:
        return
    is_file = held == [path] and fs.isfile(path)
    writes_file = to == "torch"
    if to is not None and is_file != writes_file:
        kind, writes = ("a prefix holding objects", "one file") if writes_file else ("a file", "a directory")
        example = f" such as '{dst}/model.pt'" if writes_file else ""
        raise CheckpointError(f"'{dst}' is {kind}, but --to {to} writes {writes}: give a new location{example}")
    if not overwrite:
        if is_file:
            raise CheckpointError(f"'{dst}' exists; give --overwrite to replace it, or write to a new file")
        raise CheckpointError(f"'{dst}' is not empty; give --overwrite to replace what it holds, or write to a new "
                              "location")
    source, here = canonical(src), str(dst).rstrip("/")
    if is_url(src) and (source == here or source.startswith(here + "/")):
        raise CheckpointError(f"'{dst}' holds {source}, which this conversion reads; --overwrite would destroy it: "
                              "write to another location")
    if is_file and writes_file:
        import tempfile

        with tempfile.TemporaryDirectory() as folder:
            fs.get_file(path, f"{folder}/model.pt")
            if not _is_torch_export(Path(folder) / "model.pt"):
                raise CheckpointError(f"'{dst}' is not a file `ember convert --to torch` wrote; --overwrite replaces "
                                      "only such a file: write to a new file")


def _is_torch_export(path: Path) -> bool:
    """Whether `path` is a file `ember convert --to torch` writes: {"model": state_dict, "ember": model.json}.
    mmap: the tensors are not read."""
    if not zipfile.is_zipfile(path):
        return False
    try:
        payload = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    except Exception:  # any unreadable file is simply not one
        return False
    return isinstance(payload, dict) and "model" in payload and "ember" in payload


def _files_read(path: Path) -> list[Path]:
    """Every file loading `path` reads: its own (model_files) and, for a LoRA checkpoint, its base's."""
    files = model_files(path)
    for file in list(files):
        base = read_json(file).get("base") if file.name == MODEL_JSON else None
        if isinstance(base, str) and Path(base).exists():
            files += _files_read(Path(base))
    return files
