"""Sharded checkpoints of the XLA path: each host writes the shards its devices hold, in ember's own DCP format.

A TPU run's checkpoint is the torch path's format (checkpoint.py: `model.*` weights, `optim.state.*` AdamW
moments and steps, `optim.param_groups`), so it resumes, evaluates, converts and fine-tunes anywhere ember
runs, and a torch run's checkpoint resumes on TPUs. Nothing is gathered: every host stages only its devices'
shards (the replica-0 copy of each, so each chunk is written once), writes them with DCP under
`step-N.tmp/host{H}/`, and process 0 merges the hosts' metadata into one `.metadata` (relative paths into the
host folders) before the atomic rename. DCP's readers reshard from the chunk list, so the torch path loads it
as it loads an FSDP checkpoint, and a resume on another mesh reads, per host, only the chunks its devices need.
DCP's save and load planners see a host's chunks through the same protocol DTensor implements
(`__create_write_items__`, `__create_chunk_list__`); without torch.distributed across the TPU hosts, each host
plans alone and the merge replaces DCP's cross-rank planning (with the same coverage check).
"""

from __future__ import annotations

import dataclasses
import math
import pickle
import time
import warnings
from collections import ChainMap
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ember.checkpoint.manager import CheckpointManager
from ember.errors import CheckpointError
from ember.storage.location import Location

HOST_DIR = "host{}"
Offsets = tuple[int, ...]


@dataclasses.dataclass
class HostChunks:
    """This host's chunks of one global tensor, as DCP's planners see a sharded tensor: offsets -> values
    (saving) or -> the buffer DCP reads into (loading)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: dict[Offsets, torch.Tensor]

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        properties = TensorProperties(dtype=self.dtype)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=_chunk(offsets, value), properties=properties,
                                                      size=torch.Size(self.shape)))
                for offsets, value in self.chunks.items()]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [_chunk(offsets, value) for offsets, value in self.chunks.items()]


def _chunk(offsets: Offsets, value: torch.Tensor) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=value.shape)


def _lookup(state: dict[str, Any], index: MetadataIndex) -> Optional[torch.Tensor]:
    obj = state.get(index.fqn)
    return obj.chunks[tuple(index.offset)] if isinstance(obj, HostChunks) else None


class _HostSavePlanner(DefaultSavePlanner):
    """DCP's default planner for one host's part: its chunks by offset, and no cross-host validation (this
    host's plan covers only its chunks; merge_hosts checks the whole)."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        found = _lookup(self.state_dict, index)
        return found if found is not None else super().lookup_object(index)

    def create_global_plan(self, all_plans: list[Any]) -> tuple[list[Any], Metadata]:
        global_plan, metadata = create_default_global_save_plan(all_plans)
        if self.flatten_state_dict:
            metadata = dataclasses.replace(metadata,
                                           planner_data=dict(ChainMap(*[p.planner_data for p in global_plan])))
        self.global_plan, self.metadata = global_plan, metadata
        return global_plan, metadata


class _HostLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading each of this host's chunks into its buffer."""

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Optional[Metadata] = None,
                       is_coordinator: bool = False) -> None:
        kept = _host_chunks(state_dict)
        super().set_up_planner(state_dict, metadata, is_coordinator)
        for path, chunks in kept.items():  # DCP's set-up replaces the objects it does not know with None
            parent = state_dict
            for key in path[:-1]:
                parent = parent[key]
            parent[path[-1]] = chunks
            self.state_dict[".".join(path)] = chunks  # DCP's flattened key

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        found = _lookup(self.state_dict, index)
        return found if found is not None else super().lookup_tensor(index)


def _host_chunks(state: dict[str, Any], path: tuple[str, ...] = ()) -> dict[tuple[str, ...], HostChunks]:
    found = {}
    for key, value in state.items():
        if isinstance(value, dict):
            found.update(_host_chunks(value, (*path, key)))
        elif isinstance(value, HostChunks):
            found[(*path, key)] = value
    return found


# ---------------------------------------------------------------------------------------------- chunks
def _device_slices(array_or_sharding: Any, shape: tuple[int, ...], replica0: bool,
                   devices: Optional[set] = None) -> list[tuple[Any, tuple]]:
    """(device or shard, index) for this host's devices (or those of `devices`): the replica-0 shards of an
    array (saving), or every addressable device of a sharding (loading)."""
    if replica0:
        return [(s, s.index) for s in array_or_sharding.addressable_shards
                if s.replica_id == 0 and (devices is None or s.device in devices)]
    return [(d, index) for d, index in array_or_sharding.addressable_devices_indices_map(shape).items()
            if devices is None or d in devices]


def _starts_sizes(index: tuple, shape: tuple[int, ...]) -> tuple[Offsets, tuple[int, ...]]:
    bounds = [s.indices(n)[:2] for s, n in zip(index, shape)]
    return tuple(a for a, _ in bounds), tuple(b - a for a, b in bounds)


def save_chunks(array: Any, fqns: list[str], devices: Optional[set] = None) -> dict[str, HostChunks]:
    """fqn -> this host's replica-0 chunks of `array` (staged on the host); a scanned array (one fqn per layer,
    stacked on dim 0) is split into its layers' chunks. `devices`: a subset of this host's (tests stand in for
    several hosts with it)."""
    stacked = len(fqns) > 1
    shape = tuple(array.shape)
    dtype = torch.from_numpy(np.zeros((), array.dtype)).dtype
    out = {fqn: HostChunks(shape[1:] if stacked else shape, dtype, {}) for fqn in fqns}
    for shard, index in _device_slices(array, shape, replica0=True, devices=devices):
        values = torch.from_numpy(np.array(shard.data, copy=True))  # a copy: the next step donates the buffer
        starts, sizes = _starts_sizes(index, shape)
        if not stacked:
            out[fqns[0]].chunks[starts] = values
            continue
        for i, layer in enumerate(range(starts[0], starts[0] + sizes[0])):
            out[fqns[layer]].chunks[starts[1:]] = values[i]
    return out


def load_targets(sharding: Any, shape: tuple[int, ...], fqns: list[str]) -> dict[str, HostChunks]:
    """fqn -> empty buffers for the chunks this host's devices hold under `sharding` (each distinct one once)."""
    stacked = len(fqns) > 1
    out = {fqn: HostChunks(shape[1:] if stacked else shape, torch.float32, {}) for fqn in fqns}
    for _, index in _device_slices(sharding, shape, replica0=False):
        starts, sizes = _starts_sizes(index, shape)
        for layer in (range(starts[0], starts[0] + sizes[0]) if stacked else [0]):
            key, size = (starts[1:], sizes[1:]) if stacked else (starts, sizes)
            out[fqns[layer]].chunks.setdefault(key, torch.empty(size, dtype=torch.float32))
    return out


def assemble(targets: dict[str, HostChunks], sharding: Any, shape: tuple[int, ...], fqns: list[str]) -> Any:
    """The global jax array of `shape` under `sharding` from the loaded buffers of load_targets."""
    import jax

    stacked = len(fqns) > 1
    pieces = []
    for device, index in _device_slices(sharding, shape, replica0=False):
        starts, sizes = _starts_sizes(index, shape)
        if stacked:
            value = np.stack([targets[fqns[layer]].chunks[starts[1:]].numpy()
                              for layer in range(starts[0], starts[0] + sizes[0])])
        else:
            value = targets[fqns[0]].chunks[starts].numpy()
        pieces.append(jax.device_put(value, device))
    return jax.make_array_from_single_device_arrays(shape, sharding, pieces)


# ---------------------------------------------------------------------------------------------- files
def _storage(folder: Location, reader: bool) -> Any:
    """DCP's reader or writer for a local folder or a URL (on object storage each host writes its own objects)."""
    if isinstance(folder, Path):
        return FileSystemReader(str(folder)) if reader else FileSystemWriter(str(folder))
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter  # no public names

    return FsspecReader(str(folder)) if reader else FsspecWriter(str(folder))


def write_host(state: dict[str, Any], host_dir: Location) -> None:
    """One host's DCP files and metadata under host_dir (no collectives: each host plans alone)."""
    host_dir.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # DCP's note that it saves without torch.distributed: each host does, by design
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=_storage(host_dir, reader=False), planner=_HostSavePlanner(), no_dist=True)


def merge_hosts(step_dir: Location, hosts: int, timeout_s: float = 3600.0) -> None:
    """Process 0: one `.metadata` for step_dir from every host's (waiting for the hosts still writing), its paths
    into the host folders; raises CheckpointError when the chunks do not cover every tensor exactly once."""
    merged: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    planner_data: dict[str, Any] = {}
    first: Optional[Metadata] = None
    for host in range(hosts):
        folder = step_dir / HOST_DIR.format(host)
        deadline = time.monotonic() + timeout_s
        while not (folder / ".metadata").is_file():
            if time.monotonic() > deadline:
                raise CheckpointError(f"checkpoint {step_dir}: host {host} wrote no metadata in {timeout_s:.0f} s")
            time.sleep(0.5)
        metadata = _storage(folder, reader=True).read_metadata()
        first = first or metadata
        planner_data.update(metadata.planner_data or {})
        for index, info in metadata.storage_data.items():
            storage[index] = dataclasses.replace(info, relative_path=f"{folder.name}/{info.relative_path}")
        for key, entry in metadata.state_dict_metadata.items():
            if isinstance(entry, TensorStorageMetadata) and key in merged:
                merged[key] = dataclasses.replace(merged[key], chunks=merged[key].chunks + entry.chunks)
            else:
                merged.setdefault(key, entry)
    for key, entry in merged.items():
        if isinstance(entry, TensorStorageMetadata):
            covered = sum(math.prod(c.sizes) for c in entry.chunks)
            if covered != math.prod(entry.size):
                raise CheckpointError(f"checkpoint {step_dir}: the hosts' chunks of '{key}' cover {covered} of "
                                      f"{math.prod(entry.size)} elements")
    metadata = dataclasses.replace(first, state_dict_metadata=merged, storage_data=storage, planner_data=planner_data)
    if not isinstance(step_dir, Path):  # an object store: no rename; model.json, written after, commits the step
        with (step_dir / ".metadata").open("wb") as f:
            pickle.dump(metadata, f)
        return
    with open(step_dir / ".metadata.tmp", "wb") as f:
        pickle.dump(metadata, f)  # DCP's own encoding of .metadata (FileSystemWriter.finish)
    (step_dir / ".metadata.tmp").replace(step_dir / ".metadata")


# ---------------------------------------------------------------------------------------------- the manager
@dataclasses.dataclass
class DeviceState:
    """What the manager reads and restores: the layout's names and shardings, and the live arrays."""

    names: dict[str, list[str]]  # device-state name -> fqns (ember/xla/layout.py: device_names)
    shapes: dict[str, tuple[int, ...]]
    param_shardings: dict[str, Any]
    opt_shardings: Any
    aliases: dict[str, str]  # tied alias fqn -> the fqn it repeats
    param_groups: list[dict[str, Any]]  # torch's param_groups with fqns (what the torch path writes)
    live: Callable[[], tuple[dict[str, Any], Any]]  # -> (params, optax state), the arrays of now


@dataclasses.dataclass
class RestoredState:
    """A resume's device arrays: weights, AdamW's first and second moments (device-state name -> array), step."""

    params: dict[str, Any]
    mu: dict[str, Any]
    nu: dict[str, Any]
    count: int


class XlaCheckpointManager(CheckpointManager):
    """CheckpointManager whose weights and optimizer state are the devices' sharded arrays (see the module)."""

    def __init__(self, *args: Any, device_state: DeviceState, **kwargs: Any):
        self.device_state = device_state
        self.restored: Optional[RestoredState] = None  # what a resume loaded
        self._writer = ThreadPoolExecutor(max_workers=1)
        super().__init__(*args, **kwargs)

    def rank(self) -> int:
        import jax

        return jax.process_index()

    def barrier(self) -> None:
        import jax
        from jax.experimental import multihost_utils

        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("ember checkpoint")

    def _staged(self) -> dict[str, Any]:
        """This host's chunks of the weights and AdamW moments (host copies), and on process 0 the step counts
        and param groups, keyed as the torch path's checkpoint."""
        d = self.device_state
        params, opt_state = d.live()
        adam = opt_state[0]
        model: dict[str, Any] = {}
        optim: dict[str, Any] = {}
        step = torch.tensor(float(np.asarray(adam.count.addressable_shards[0].data)))
        for name, fqns in d.names.items():
            weights, mu, nu = (save_chunks(tree[name], fqns) for tree in (params, adam.mu, adam.nu))
            model.update(weights)
            for fqn in fqns:
                optim[fqn] = {"exp_avg": mu[fqn], "exp_avg_sq": nu[fqn]} | ({"step": step} if self.rank() == 0 else {})
        model.update({alias: model[primary] for alias, primary in d.aliases.items()})
        state: dict[str, Any] = {"model": model, "optim": {"state": optim}}
        if self.rank() == 0:
            state["optim"]["param_groups"] = d.param_groups
        return state

    def _write(self, tmp: Location, blocking: bool) -> Optional[Future]:
        state = self._staged()
        job = lambda: write_host(state, tmp / HOST_DIR.format(self.rank()))  # noqa: E731
        if blocking or not self.cfg.async_save:
            job()
            return None
        return self._writer.submit(job)

    def _commit(self, tmp: Location, final: Location) -> None:
        import jax

        if self.rank() == 0:
            merge_hosts(tmp, jax.process_count())
        super()._commit(tmp, final)

    # ------------------------------------------------------------------ load
    def _state(self) -> dict[str, Any]:
        """What a resume reads: this host's chunks of every weight and moment, the steps and param groups."""
        d = self.device_state
        model: dict[str, Any] = {}
        optim: dict[str, Any] = {}
        for name, fqns in d.names.items():
            model.update(load_targets(d.param_shardings[name], d.shapes[name], fqns))
            mu, nu = (load_targets(d.param_shardings[name], d.shapes[name], fqns) for _ in range(2))
            optim.update({fqn: {"step": torch.tensor(0.0), "exp_avg": mu[fqn], "exp_avg_sq": nu[fqn]} for fqn in fqns})
        return {"model": model, "optim": {"state": optim, "param_groups": d.param_groups}}

    def _load_planner(self) -> Any:
        return _HostLoadPlanner()

    def _restore(self, state: dict[str, Any], settings: Any) -> None:
        """The loaded chunks as the devices' arrays (AdamW's moments and step count for optax's state); this run's
        optim.* stand, as on the torch path."""
        d = self.device_state
        model, moments = state["model"], state["optim"]["state"]
        params, mu, nu = {}, {}, {}
        for name, fqns in d.names.items():
            sharding, shape = d.param_shardings[name], d.shapes[name]
            params[name] = assemble(model, sharding, shape, fqns)
            mu[name] = assemble({f: moments[f]["exp_avg"] for f in fqns}, sharding, shape, fqns)
            nu[name] = assemble({f: moments[f]["exp_avg_sq"] for f in fqns}, sharding, shape, fqns)
        count = int(float(next(iter(moments.values()))["step"]))
        self.restored = RestoredState(params, mu, nu, count)
