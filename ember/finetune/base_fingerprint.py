"""The fingerprint of a LoRA run's base, recorded in its model.json beside the base's path ("base_fingerprint"),
so that a base overwritten since (re-exported onto, trained further, another model copied there) is refused
when the run is loaded or resumed, instead of the adapters silently running on other weights.

A fingerprint maps each file the base's load reads (weights and their descriptions: safetensors, DCP shards,
config.json / model.json; a peft adapter's base too, since it is folded in) to its size and the sha256 of its
whole content. Whole content, not sampled chunks: a base re-exported after a small change (one tensor, one
layer) differs in bytes a sample would likely miss, and the point is to be sure. Hashing runs at disk speed
(~10 s for 16 GB), so digests are cached per machine keyed by (device, inode, size, mtime, ctime): any write
to a file, or another file moved or copied into its place, gives it a new ctime (set by the kernel; tools that
copy timestamps set mtime only), so a cached digest is reused only for the same, unchanged file. A file whose
timestamps are too recent to tell a later same-tick write apart is hashed again next time, not cached (git's
"racily clean" rule).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch.distributed as dist

from ember.constants import default_cache_dir
from ember.errors import CheckpointError, ConfigError, EmberError
from ember.finetune.peft_format import ADAPTER_CONFIG, check_adapter_config, peft_base
from ember.model_io.model_meta import MODEL_JSON, ember_step_dir, read_json
from ember.storage.cache import local_copy
from ember.storage.location import as_path, canonical

FINGERPRINT_KEY = "base_fingerprint"
REFERENCE_FINGERPRINT_KEY = "reference_fingerprint"  # task=dpo without LoRA: model.init_from, the reference
# What load_model reads from a directory: HF (config.json, index, safetensors), ember (model.json, DCP's
# .metadata and shards), peft (adapter_config.json, adapter_model.safetensors). Not tokenizers, READMEs or a
# checkpoint's train-rank*.pt (training state), whose change leaves the weights as they were.
_WEIGHT_NAMES = ("config.json", MODEL_JSON, ".metadata", ADAPTER_CONFIG, "model.safetensors.index.json")
_WEIGHT_SUFFIXES = (".safetensors", ".distcp")
_RACY_NS = 2_000_000_000  # timestamps closer than this to the hashing may not yet show a write (FAT, NFS: 1-2 s)
_CACHE_NAME = "file_digests.json"


def model_files(path: Union[str, Path]) -> list[Path]:
    """The files load_model reads for `path` (a run directory: its newest complete step; a peft adapter: its
    base's files too), resolved, in a stable order."""
    return [file for _, file in _named_files(local_copy(path, "model.init_from").resolve())]


def fingerprint(path: Union[str, Path]) -> dict[str, dict[str, Any]]:
    """{file name: {"bytes", "sha256"}} of what loading `path` reads. Names are relative to `path` (a peft
    adapter's base's under "base/"), so a copy of the base elsewhere has the same fingerprint."""
    cache = _DigestCache()
    prints = {name: {"bytes": file.stat().st_size, "sha256": cache.digest(file)}
              for name, file in _named_files(local_copy(path, "model.init_from").resolve())}
    cache.save()
    return prints


def _named_files(root: Path, prefix: str = "") -> list[tuple[str, Path]]:
    if root.is_file():
        return [(prefix + root.name, root)]
    step_dir = ember_step_dir(root) or root
    files = [(prefix + str(p.relative_to(root)), p) for p in sorted(step_dir.iterdir())
             if p.is_file() and (p.name in _WEIGHT_NAMES or p.suffix in _WEIGHT_SUFFIXES)]
    if (step_dir / ADAPTER_CONFIG).is_file() and not (step_dir / MODEL_JSON).is_file():
        config = check_adapter_config(read_json(step_dir / ADAPTER_CONFIG), step_dir)
        files += _named_files(peft_base(config, step_dir).resolve(), prefix + "base/")
    return files


def run_fingerprint(path: Union[str, Path]) -> dict[str, dict[str, Any]]:
    """fingerprint(path) computed once per job (rank 0) and shared, so N ranks do not all read a large base."""
    if not (dist.is_available() and dist.is_initialized()):
        return fingerprint(path)
    result: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            result = [fingerprint(path)]
        except (OSError, EmberError) as err:  # every rank raises it, none waits for rank 0
            result = [f"the base model.init_from={path} cannot be fingerprinted: {err}"]
    dist.broadcast_object_list(result, src=0)
    if isinstance(result[0], str):
        raise CheckpointError(result[0])
    return result[0]


def differences(recorded: dict[str, Any], now: dict[str, Any]) -> str:
    """What changed between two fingerprints, for a one-line message ('' when they are equal)."""
    changed = sorted(k for k in set(recorded) & set(now) if recorded[k] != now[k])
    gone, new = sorted(set(recorded) - set(now)), sorted(set(now) - set(recorded))
    parts = []
    for word, names in (("changed", changed), ("gone", gone), ("added", new)):
        if names:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            parts.append(f"{', '.join(names[:3])}{more} {word}")
    return "; ".join(parts)


def check_lora_base(step_dir: Path, meta: dict[str, Any]) -> None:
    """Refuse to load a LoRA checkpoint whose base's files are no longer those it was trained on. A
    checkpoint without a fingerprint (written before ember recorded one) is read as it is."""
    recorded = meta.get(FINGERPRINT_KEY)
    if not isinstance(recorded, dict):
        return
    changes = differences(recorded, fingerprint(meta["base"]))
    if changes:
        raise CheckpointError(f"'{step_dir}' holds LoRA adapters trained on the base '{meta['base']}', which has "
                              f'changed since ({changes}); put that base back there, or point "base" in its '
                              f"{MODEL_JSON} at a copy of it: adapters fit only the weights they were trained on")


def reference_meta(init_from: str) -> dict[str, Any]:
    """What a full (non-LoRA) DPO checkpoint's model.json adds: the path and fingerprint of model.init_from, from
    which a resumed run rebuilds its frozen reference (the checkpoint holds only the policy)."""
    reference = canonical(init_from)
    return {"reference": reference, REFERENCE_FINGERPRINT_KEY: run_fingerprint(reference)}


def check_resume_base(step_dir: Path, run_meta: dict[str, Any]) -> None:
    """Refuse to resume a checkpoint on another base than it was trained on (model.init_from overwritten, or
    pointing elsewhere): a LoRA run's frozen base, or a full DPO run's reference, rebuilt from it on resume,
    would otherwise be other weights without a word."""
    saved = read_json(step_dir / MODEL_JSON)
    for key, path_key, what in ((FINGERPRINT_KEY, "base", "base"),
                                (REFERENCE_FINGERPRINT_KEY, "reference", "DPO reference")):
        recorded, now = saved.get(key), run_meta.get(key)
        if not isinstance(recorded, dict) or now is None:
            continue
        changes = differences(recorded, now)
        if changes:
            raise ConfigError(f"resume: checkpoint {step_dir} was trained with another {what} than "
                              f"model.init_from={run_meta[path_key]} holds now ({changes}); resume on the "
                              "weights it was trained with, or start over on these with resume=none (the old "
                              "run is moved aside)")


@contextlib.contextmanager
def resumed_base(resume: str, output_dir: Union[str, Path], init_from: str) -> Iterator[None]:
    """Loading model.init_from at the start of a run; when it fails and the checkpoint the run would resume was
    trained on it (a LoRA run's base, a full DPO run's reference: both rebuilt from model.init_from on resume),
    the error says so, what changed and what to do, instead of only that a directory lacks a file."""
    try:
        yield
    except EmberError as err:
        step_dir = _checkpoint_to_resume(resume, as_path(output_dir))
        saved = read_json(step_dir / MODEL_JSON) if step_dir is not None else {}
        base = canonical(init_from)
        for key, path_key, what in ((FINGERPRINT_KEY, "base", "base"),
                                    (REFERENCE_FINGERPRINT_KEY, "reference", "DPO reference")):
            if saved.get(path_key) == base and isinstance(saved.get(key), dict):
                try:
                    found = differences(saved[key], fingerprint(base)) or str(err)
                except (OSError, EmberError):
                    found = str(err)
                raise ConfigError(f"resume: checkpoint {step_dir} was trained on the {what} model.init_from={base}, "
                                  f"which cannot be loaded now ({found}); put the {what} it was trained on back "
                                  "there, or start over on other weights with resume=none (the old run is moved "
                                  "aside)") from None
        raise


def _checkpoint_to_resume(resume: str, output_dir: Path) -> Optional[Path]:
    """The checkpoint `resume` names (auto: the run's newest complete one), or None."""
    if resume == "none":
        return None
    try:
        return ember_step_dir(output_dir if resume == "auto" else as_path(resume))
    except EmberError:  # no complete checkpoint there: nothing to resume
        return None


class _DigestCache:
    """sha256 of files, cached in the ember cache directory by (device, inode, size, mtime, ctime); losing
    the cache, or a write lost to another process writing it at once, only costs a re-hash."""

    def __init__(self) -> None:
        self.path = default_cache_dir() / _CACHE_NAME
        try:
            self.entries = json.loads(self.path.read_text()).get("files", {})
        except (OSError, ValueError, AttributeError):
            self.entries = {}
        self.dirty = False

    def digest(self, file: Path) -> str:
        before = _stamp(file)
        hit = self.entries.get(str(file))
        if isinstance(hit, list) and len(hit) == 2 and hit[0] == before:
            return hit[1]
        with file.open("rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        settled = time.time_ns() - max(before[3], before[4]) > _RACY_NS
        if settled and _stamp(file) == before:  # unchanged while read, and too old to change unseen
            self.entries[str(file)] = [before, digest]
            self.dirty = True
        return digest

    def save(self) -> None:
        if not self.dirty:
            return
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"files": self.entries}))
            os.replace(tmp, self.path)
        except OSError:  # a read-only or full cache directory: the digests are only recomputed next time
            tmp.unlink(missing_ok=True)


def _stamp(file: Path) -> list[int]:
    st = file.stat()
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
