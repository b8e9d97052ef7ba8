"""Training checkpoints: distributed (DCP), atomic, optionally asynchronous, kept N at a time, resumable.

A checkpoint is `OUTPUT_DIR/checkpoints/step-N/`:
- DCP files of {"model": weights, "optim": optimizer state}, sharded as the run was and resharded on
  load (a checkpoint of fsdp=2 loads on one process or with tensor=2);
- `train-rank{R}.pt`: that rank's small training state (step, LR schedule, data-loader position, RNG
  states), written with torch.save and read back with weights_only=True;
- `run_config.yaml`: the config of the run that saved it, which a resume compares with its own
  (ember/checkpoint/run_history.py: what may change on resume and what may not);
- `model.json`, written last: the marker of a complete checkpoint (and what `load_model` reads).

Atomic: everything is written under `step-N.tmp` and renamed to `step-N` by rank 0 once every rank is
done, so a crash at any point leaves the previous checkpoints intact; leftover `.tmp` folders are removed
at the next start. On an object store (output_dir=s3://..., gs://...), which has no rename, `step-N/` is
written in place and `model.json`, written last by rank 0 after every rank's shards and DCP's metadata, is
the commit marker: a step without it is never loaded, and is deleted at the next start. Asynchronous saves
(`checkpoint.async_save`) stage the state in host memory, write it in the background over a process group of
their own (on gloo, sharing the default group was seen to hang), and are committed at a later step boundary.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from ember.checkpoint.run_dir import STEP_DIR, STEP_TMP, archive_previous_run, complete_checkpoints, starts_over
from ember.checkpoint.run_history import (
    CHECKPOINT_CONFIG,
    Change,
    RunChanged,
    config_dict,
    describe_changes,
    resume_changes,
)
from ember.config_schema import CheckpointConfig
from ember.errors import CheckpointError, ConfigError, first_error_line
from ember.finetune.base_fingerprint import check_resume_base, reference_meta
from ember.finetune.lora import lora_meta
from ember.finetune.lora_state import START, buffer_names, lora_state_dict, start_buffers, unsaved_buffers
from ember.model_io.load import model_state_dict
from ember.model_io.model_meta import MODEL_JSON, ArchitectureMismatch, check_architecture, meta_for
from ember.storage.location import Location, as_path, remove_tree
from ember.train.optim import apply_group_settings, group_settings

if TYPE_CHECKING:
    from ember.train.run import RunSpec

def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def verify(step_dir: Location, template: dict[str, Any]) -> None:
    """Check a checkpoint against what this run will load, before loading: every shard file present and
    long enough, every tensor of the same global shape. Names the first problem."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader
    if not isinstance(step_dir, Path):  # a URL: DCP's fsspec reader (no public name), imported only then
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        reader = FsspecReader
    try:
        metadata = reader(str(step_dir)).read_metadata()
    except Exception as err:
        raise CheckpointError(f"checkpoint {step_dir}: its .metadata cannot be read "
                              f"({first_error_line(err)})") from None
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = step_dir / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {step_dir}: shard file {name} is missing")
        if path.stat().st_size < size:
            raise CheckpointError(f"checkpoint {step_dir}: shard file {name} is truncated "
                                  f"({path.stat().st_size} of at least {size} bytes)")
    for key, value in _flatten(template).items():
        shape = getattr(value, "shape", None)  # a tensor, or a host's chunks of one (ember/xla/checkpoint.py)
        if shape is None:
            continue  # lists and numbers (param_groups) are flattened by DCP its own way
        stored = metadata.state_dict_metadata.get(key)
        if stored is None:
            raise CheckpointError(f"checkpoint {step_dir} has no '{key}'; it was saved from another model or optimizer")
        shape = tuple(shape)
        if isinstance(stored, TensorStorageMetadata) and tuple(stored.size) != shape:
            raise CheckpointError(f"checkpoint {step_dir}: '{key}' has shape {tuple(stored.size)} but this run's "
                                  f"model has {shape}; resume with the same model config or resume=none")


def _flatten(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    # DCP's own key flattening: nested dicts joined with dots.
    out: dict[str, Any] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def rng_state() -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class CheckpointManager:
    """Saves and restores the whole training state of one run; every rank calls every method."""

    def __init__(self, cfg: CheckpointConfig, output_dir: Union[str, Location], model_parts: list[nn.Module],
                 optim_model: nn.Module, optimizer: torch.optim.Optimizer, meta: dict[str, Any],
                 say: Callable[[str], None] = print, adapters_only: bool = False,
                 run_config: Optional[dict[str, Any]] = None, allow_changes: Sequence[str] = ()):
        self.cfg, self.dir = cfg, as_path(output_dir) / "checkpoints"
        self.in_place = not isinstance(self.dir, Path)  # an object store: no rename, model.json commits a step
        # The whole job config (as config.yaml holds it), saved beside the weights and compared on resume; the
        # keys of what the run is that this resume may change (resume_allow_changes).
        self.run_config, self.allow_changes = run_config, tuple(allow_changes)
        self.resumed_from: Optional[Path] = None  # the checkpoint resume() loaded
        self.changes: list[Change] = []  # what this run changed against it
        # LoRA: the frozen base is model.init_from's (meta["base"]), so only the trainable tensors and the buffers are
        # saved, with the buffers' values at the start (finetune/lora_state.py)
        self.adapters_only = adapters_only
        self.start_buffers = start_buffers(model_parts) if adapters_only else {}
        self.model_parts, self.optim_model, self.optimizer = model_parts, optim_model, optimizer
        self.meta, self.say = meta, say
        self._pending: Optional[tuple[Any, Location, Location]] = None  # async save in flight: (future, tmp, final)
        self._async_group = None
        self.on_commit: Callable[[], None] = lambda: None  # rank 0, after each commit (a remote run's mirror push)
        if self.rank() == 0 and self.dir.is_dir():
            for leftover in self.dir.iterdir():  # a save that a crash interrupted
                if STEP_TMP.fullmatch(leftover.name) or (self.in_place and STEP_DIR.fullmatch(leftover.name)
                                                         and not (leftover / MODEL_JSON).is_file()):
                    remove_tree(leftover)
                    self.say(f"removed the incomplete checkpoint {leftover.name} left by an interrupted save")
        self.barrier()

    def rank(self) -> int:
        return _rank()

    def barrier(self) -> None:
        _barrier()

    # ------------------------------------------------------------------ state
    def _state(self) -> dict[str, Any]:
        model = lora_state_dict(self.model_parts) if self.adapters_only else model_state_dict(self.model_parts)
        state = {"model": model, "optim": get_optimizer_state_dict(self.optim_model, self.optimizer)}
        return {**state, START: self.start_buffers} if self.start_buffers else state

    # ------------------------------------------------------------------ save
    def due(self, step: int) -> bool:
        return self.cfg.interval > 0 and step % self.cfg.interval == 0

    def save(self, step: int, train_state: dict[str, Any], *, blocking: bool = False) -> None:
        """Write step-N (asynchronously when checkpoint.async_save and not `blocking`)."""
        self.wait()  # one save in flight at a time
        final = self.dir / f"step-{step}"
        tmp = final if self.in_place else final.with_name(final.name + ".tmp")
        if self.rank() == 0:
            remove_tree(tmp)  # in place: a step saved again loses its marker before its files change
            tmp.mkdir(parents=True, exist_ok=True)
        self.barrier()
        with (tmp / f"train-rank{self.rank()}.pt").open("wb") as file:
            torch.save(train_state, file)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # DCP's notes on single-process use
            future = self._write(tmp, blocking)
        if future is not None:
            self._pending = (future, tmp, final)
            return
        self._commit(tmp, final)
        self.barrier()

    def _write(self, tmp: Location, blocking: bool) -> Optional[Any]:
        """The weights and optimizer state into tmp; a future while an asynchronous save writes on."""
        state = self._state()
        if self.cfg.async_save and not blocking:
            if self._async_group is None and dist.is_initialized():
                self._async_group = dist.new_group(backend="gloo")
            return dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._async_group)
        dcp.save(state, checkpoint_id=str(tmp))
        return None

    def _commit(self, tmp: Location, final: Location) -> None:
        """Rank 0, once every rank's shards and the metadata are written: marker, rename, prune."""
        if self.rank() != 0:
            return
        if self.run_config is not None:
            (tmp / CHECKPOINT_CONFIG).write_text(yaml.safe_dump(self.run_config, sort_keys=False), encoding="utf-8")
        (tmp / MODEL_JSON).write_text(json.dumps(self.meta, indent=2) + "\n")
        if not self.in_place:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        self._prune()
        self.on_commit()

    def _prune(self) -> None:
        keep, every = self.cfg.keep, self.cfg.keep_every
        if keep <= 0:
            return
        checkpoints = complete_checkpoints(self.dir)
        for step, path in checkpoints[:-keep]:
            if every > 0 and step % every == 0:
                continue  # a milestone
            remove_tree(path)

    def poll(self) -> None:
        """Commit a finished asynchronous save (call at step boundaries)."""
        if self._pending is not None and self._pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Block until the save in flight is written, then commit it."""
        if self._pending is None:
            return
        future, tmp, final = self._pending
        self._pending = None
        future.result()  # raises if writing failed; DCP completes it only after the metadata is written
        self._commit(tmp, final)

    # ------------------------------------------------------------------ load
    def resume(self, spec: str) -> Optional[dict[str, Any]]:
        """Restore model and optimizer from the checkpoint `spec` names ("auto": the newest complete one in
        this run's directory, falling back to older ones if it is unreadable; "none"; or a path) and return
        this rank's training state, or None to start from scratch."""
        if spec == "none":
            return None
        if spec == "auto":
            candidates = [path for _, path in reversed(complete_checkpoints(self.dir))]
            for i, path in enumerate(candidates):
                try:
                    return self.load(path)
                except (ArchitectureMismatch, RunChanged):
                    raise  # every checkpoint of the run has that architecture and config: no older one fits better
                except CheckpointError as err:
                    if i + 1 == len(candidates):  # never train from scratch over checkpoints left unused
                        raise CheckpointError(f"{err}; no checkpoint in {self.dir} can be resumed: fix or remove "
                                              "them, or start over with resume=none (which moves them aside)") from None
                    self.say(f"warning: {err}; falling back to {candidates[i + 1].name}")
            # get_optimizer_state_dict initialised the optimizer with a zero step (Adam's step count 1);
            # a run from scratch must start from an empty state, as one that never tried to resume.
            self.optimizer.state.clear()
            return None
        path = as_path(spec)
        if (path / "checkpoints").is_dir() and not (path / MODEL_JSON).is_file():
            found = complete_checkpoints(path / "checkpoints")
            if not found:
                raise CheckpointError(f"resume={spec}: no complete checkpoint under {path / 'checkpoints'}")
            path = found[-1][1]
        if not (path / MODEL_JSON).is_file():
            raise CheckpointError(f"resume={spec}: {path} is not a complete checkpoint (no {MODEL_JSON}); "
                                  "give a checkpoints/step-N directory")
        return self.load(path)

    def load(self, step_dir: Location) -> dict[str, Any]:
        check_architecture(step_dir, self.meta)  # first: it names the resolved hyper-parameters that differ
        found = resume_changes(step_dir, self.run_config, self.allow_changes, self.say) if self.run_config else []
        check_resume_base(step_dir, self.meta)  # a LoRA run's base overwritten since: a ConfigError, no fallback
        state = self._state()
        unsaved = unsaved_buffers(step_dir, state, buffer_names(self.model_parts)) if self.adapters_only else []
        if unsaved:
            self.say(f"note: {step_dir} holds no {', '.join(unsaved)} (saved before LoRA checkpoints kept buffers): "
                     "the run goes on from the base's")
        settings = group_settings(self.optimizer)  # this run's optim.* (the checkpoint's replace them in `state`)
        try:
            verify(step_dir, state)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                try:
                    dcp.load(state, checkpoint_id=str(step_dir), planner=self._load_planner())
                except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
                    raise CheckpointError(f"checkpoint {step_dir} cannot be loaded: {first_error_line(err)}") from None
        except CheckpointError as err:
            allowed = [c.key for c in found if c.identity]
            if allowed:  # the change may be what fails: an older checkpoint of the run would fail the same way
                raise RunChanged(f"{err}; with resume_allow_changes changing {', '.join(allowed)}, no older "
                                 "checkpoint is tried: resume with the checkpoint's values (then a damaged checkpoint "
                                 "falls back to the one before), or start over with resume=none (the old run is moved "
                                 "aside) or a new output_dir") from None
            raise
        self._restore(state, settings)
        rank_file = step_dir / f"train-rank{self.rank()}.pt"
        if not rank_file.is_file():  # another world size: the global data position is the same on every rank
            rank_file = step_dir / "train-rank0.pt"
        try:
            with rank_file.open("rb") as file:
                train_state = torch.load(file, weights_only=True)
        except Exception as err:
            raise CheckpointError(f"checkpoint {step_dir}: {rank_file.name} is unreadable "
                                  f"({first_error_line(err)})") from None
        self.say(f"resumed from {step_dir} (step {train_state['step']})")
        # the changes are said by open_checkpoints, once every check of the resumed run has passed
        self.resumed_from, self.changes = step_dir, found
        return train_state

    def _load_planner(self) -> Any:
        return None  # DCP's default

    def live_state(self) -> dict[str, Any]:
        """The weights and optimizer state a checkpoint saves, as live tensors (a replica group's healing copy)."""
        return self._state()

    def load_live_state(self, fill: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        """live_state() filled in place by `fill` (a peer's copied in), then given to the optimizer as a load would."""
        settings = group_settings(self.optimizer)
        self._restore(fill(self._state()), settings)

    def _restore(self, state: dict[str, Any], settings: Any) -> None:
        """The loaded state into the model (loaded in place) and the optimizer, under this run's optim.*."""
        apply_group_settings(state["optim"]["param_groups"], settings)  # before loading: fused/foreach place state
        set_optimizer_state_dict(self.optim_model, self.optimizer, state["optim"])


def open_checkpoints(spec: RunSpec, model_parts: list[nn.Module], model: nn.Module, optimizer: torch.optim.Optimizer,
                     say: Callable[[str], None], manager_type: Optional[Callable[..., "CheckpointManager"]] = None,
                     ) -> tuple["CheckpointManager", Optional[dict[str, Any]]]:
    """The run's CheckpointManager and the training state resumed through it (None: from scratch). Its model.json
    names the model that was built and, for LoRA, the base the adapters sit on; for a full DPO run, the
    reference (model.init_from) that a resume rebuilds. A run that starts over (resume=none, or another run's
    checkpoint) moves the files of the run in its output_dir aside, once the checkpoint it names has been checked
    and loaded and has steps left to train: a refused or finished resume leaves that run as it was. manager_type:
    another CheckpointManager (the XLA path's, over sharded device arrays), called with CheckpointManager's arguments.
    precision=auto keeps a resumed run's dtype (ember.train.run.choose_precision, with `resumed_compute`)."""
    cfg, output_dir = spec.cfg, spec.cfg.output_dir
    meta = meta_for(cfg.model.family, spec.flavor, spec.args)
    if cfg.lora.rank:  # a LoRA checkpoint holds the adapters and their optimizer state, and names its base
        meta.update(lora_meta(cfg.lora, cfg.model.init_from))
    elif (cfg.task == "dpo" or (cfg.task == "grpo" and cfg.grpo.beta > 0)) and cfg.model.init_from:
        meta.update(reference_meta(cfg.model.init_from))
    manager = (manager_type or CheckpointManager)(
        cfg.checkpoint, output_dir, model_parts, model, optimizer, meta, say=say, adapters_only=bool(cfg.lora.rank),
        run_config=config_dict(cfg), allow_changes=cfg.resume_allow_changes)
    try:
        state = manager.resume(cfg.resume)
    except CheckpointError as err:
        raise ConfigError(str(err)) from None
    # A checkpoint already at max_steps trains nothing and writes nothing (the trainer says so): no change is
    # recorded, and the run there stays where it is.
    trains = state is None or int(state["step"]) < cfg.max_steps
    if manager.changes and trains:
        say(describe_changes(manager.changes))
    if starts_over(cfg.resume, output_dir) and trains:
        archive_previous_run(output_dir, say, f"resume={cfg.resume}")
    return manager, state
