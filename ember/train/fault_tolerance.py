"""In-job fault tolerance over replica groups, with torchft (fault_tolerance.* keys).

A job of R replica groups is R torchrun jobs of the same layout (each its own mesh: fsdp, tensor, ...), joined by
torchft's lighthouse. Each step every group computes its share of the global batch; then, instead of a
data-parallel all-reduce that hangs when a peer dies, the groups in the step's quorum average their gradients
(this rank's local shards with the same rank of every other group) through torchft's Manager, which drops a group
that stops answering and commits the step only where every rank of a group agrees. A restarted group joins the
next quorum, and torchft copies a live peer's state to it (healing): weights, optimizer, schedule, data position,
RNG, the step. With semi_sync=diloco the groups step alone and meet every diloco.sync_steps steps (torchft's DiLoCo).

What ember adds around torchft: the group's data shard (group g reads the g-th share of each global batch, so a step
without a group skips that group's rows and the data order of the others stays exact), the group's own output
directory (any group can restart from its own checkpoints), a step retried on the same batch when it does not
commit, the steps that ran with fewer groups recorded, and a healing transport that never unpickles code.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from datetime import timedelta
from typing import Any, Callable, Iterable, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ember.config_schema import FaultToleranceConfig, JobConfig
from ember.errors import ConfigError

GROUP_ENV = "EMBER_REPLICA_GROUP"  # this process's replica group, 0..R-1 (ember launch sets it)
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own: the lighthouse's http://host:port
SEMI_SYNC = ("none", "diloco")


def replica_groups(cfg: JobConfig) -> int:
    """The replica groups the global batch is split over: 1 without fault tolerance."""
    return cfg.fault_tolerance.replica_groups if cfg.fault_tolerance.enable else 1


def check(cfg: JobConfig) -> None:
    """fault_tolerance.* against each other and the run: one ConfigError naming the key."""
    ft = cfg.fault_tolerance
    if not ft.enable:
        return
    if ft.replica_groups < 1:
        raise ConfigError(f"fault_tolerance.replica_groups must be >= 1, got {ft.replica_groups}")
    if not 1 <= ft.min_replica_groups <= ft.replica_groups:
        raise ConfigError(f"fault_tolerance.min_replica_groups={ft.min_replica_groups} must be in [1, "
                          f"fault_tolerance.replica_groups={ft.replica_groups}]")
    if ft.semi_sync not in SEMI_SYNC:
        raise ConfigError(f"fault_tolerance.semi_sync={ft.semi_sync!r}: choose one of {', '.join(SEMI_SYNC)}")
    if ft.semi_sync == "diloco" and ft.diloco.sync_steps < 1:
        raise ConfigError(f"fault_tolerance.diloco.sync_steps must be >= 1, got {ft.diloco.sync_steps}")
    if ft.semi_sync == "diloco":  # the groups hold one model only right after a sync: save and end there
        interval = cfg.checkpoint.interval if cfg.checkpoint.interval < cfg.max_steps else 0  # (saves at the end)
        for key, value in (("max_steps", cfg.max_steps), ("checkpoint.interval", interval)):
            if value % ft.diloco.sync_steps:
                raise ConfigError(f"{key}={value} is not a multiple of fault_tolerance.diloco.sync_steps="
                                  f"{ft.diloco.sync_steps}: DiLoCo's groups hold one model only right after a sync; "
                                  "save and end there")
    if min(ft.timeout_s, ft.quorum_timeout_s) <= 0:
        raise ConfigError("fault_tolerance.timeout_s and fault_tolerance.quorum_timeout_s must be > 0")
    if cfg.device in ("tpu", "xla"):
        raise ConfigError(f"fault_tolerance.enable=true runs on the torch engine (device=cpu|cuda), not device="
                          f"{cfg.device}: XLA SPMD has no replica groups; restart from checkpoints there")
    if cfg.task != "lm":
        raise ConfigError(f"fault_tolerance.enable=true trains task=lm; task={cfg.task}'s reference, rollouts and "
                          f"metrics are not shared over replica groups: run task={cfg.task} without fault_tolerance")
    # torchft's Rust side logs every quorum and commit at INFO (six lines a step); its warnings and errors stay
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise ConfigError("fault_tolerance.enable=true needs torchft: pip install -e '.[ft]' (with your torch on "
                          "the same pip line)") from None


def group_from_env(ft: FaultToleranceConfig) -> int:
    """This process's replica group from $EMBER_REPLICA_GROUP, checked against fault_tolerance.replica_groups."""
    raw = os.environ.get(GROUP_ENV)
    if raw is None or not raw.isdigit() or int(raw) >= ft.replica_groups:
        groups = "0" if ft.replica_groups == 1 else f"0..{ft.replica_groups - 1}"
        raise ConfigError(f"fault_tolerance.enable=true: ${GROUP_ENV} must name this process's replica group, "
                          f"{groups} (got {raw!r}); start the groups with `ember launch local --replica-groups R`, "
                          "or set it for each group's torchrun")
    if not os.environ.get(LIGHTHOUSE_ENV):
        raise ConfigError(f"fault_tolerance.enable=true: ${LIGHTHOUSE_ENV} must give the torchft lighthouse's "
                          "address (http://host:port); `ember launch local --replica-groups R` starts one")
    return int(raw)


def group_dir(output_dir: str, group: int) -> str:
    """Where group `group` keeps its run: group 0 in output_dir itself (what `ember report` reads), the others
    beside it in output_dir/replica-group-<g>, each with its own checkpoints, so any group restarts alone."""
    return output_dir if group == 0 else f"{output_dir.rstrip('/')}/replica-group-{group}"


def local_tensors(tree: Any) -> Any:
    """`tree` with every DTensor replaced by this rank's shard and every tensor on the host: what a peer of the same
    layout copies into its own shards."""
    leaves, spec = tree_flatten(tree)
    return tree_unflatten([_local(x).detach().cpu() if isinstance(x, torch.Tensor) else x for x in leaves], spec)


def copy_into(own: Any, received: Any) -> Any:
    """`own` (this rank's state tree) with each tensor overwritten in place by `received`'s (local_tensors of a
    peer's), and every other value taken from it. The trees must have one structure: the same model and layout."""
    mine, spec = tree_flatten(own)
    theirs, their_spec = tree_flatten(received)
    if spec != their_spec:
        raise RuntimeError("a replica group's healing state does not have this group's structure: every group must "
                           "run the same model, layout and optimizer")
    out = []
    for a, b in zip(mine, theirs):
        if isinstance(a, torch.Tensor):
            _local(a).copy_(b)
            out.append(a)
        else:
            out.append(b)
    return tree_unflatten(out, spec)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _transport(timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport, with the receiving side loading tensors and plain values only
    (weights_only=True): a peer's state is data, never code. torchft's own loads with weights_only=False."""
    from torch.distributed._serialization import _streaming_load
    from torchft.checkpointing.http_transport import HTTPTransport

    class SafeHTTPTransport(HTTPTransport):
        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            import urllib.request

            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
                return _streaming_load(f, weights_only=True)

    return SafeHTTPTransport(timeout=timeout, num_chunks=0)


class ReplicaGroups:
    """This rank's view of the replica groups: torchft's Manager over a reconfigurable gloo/NCCL group with the
    same rank of every other group. Every rank of every group calls start_step, average and commit once per step."""

    def __init__(self, ft: FaultToleranceConfig, group: int, rank: int, world_size: int, device: torch.device,
                 run_dir: str = "", max_steps: int = 0):
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        self.cfg, self.group, self.count = ft, group, ft.replica_groups
        self.run_dir, self.max_steps = run_dir, max_steps  # this group's run directory, to find its peers' runs
        if device.type != "cuda":  # torchft says at every quorum that it cannot reset NCCL's flight recorder
            logging.getLogger("torchft.manager").addFilter(lambda record: "flight recorder" not in record.getMessage())
        self._store = None
        if "MASTER_PORT" not in os.environ:  # one process, no torchrun: the group's store is this process's own
            self._store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            store_addr, store_port = "127.0.0.1", self._store.port
        else:
            store_addr, store_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        timeout = timedelta(seconds=ft.timeout_s)
        self._pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        self._group_world = world_size
        self.manager = Manager(
            pg=self._pg, load_state_dict=None, state_dict=None, min_replica_size=ft.min_replica_groups,
            # a synchronous quorum heals before the step's batch is read (and DiLoCo requires it)
            use_async_quorum=False, timeout=timeout, quorum_timeout=timedelta(seconds=ft.quorum_timeout_s),
            connect_timeout=timeout, rank=rank, world_size=world_size, store_addr=store_addr, store_port=store_port,
            replica_id=f"ember_{group}", hostname=socket.gethostname(), checkpoint_transport=_transport(timeout),
            # every group starts from the same seed-determined weights (or checkpoint): no copy at step 0
            init_sync=False)
        self.committed = True  # the last step's verdict
        self._first_quorum_done = False  # wait_for_groups' quorum stands for the first step's
        self.participants: list[int] = list(range(self.count))  # the groups in the last step's quorum

    def heal_with(self, checkpointer: Any, train_state: Callable[[], dict], load_train_state: Callable[[dict], None],
                  say: Callable[[str], None]) -> None:
        """What a group behind its peers receives from a live one (torchft calls `save` on the peer, `load` here):
        the weights and optimizer state a checkpoint holds (ember/checkpoint/manager.py's live_state), and the
        trainer's state (step, schedule, data position, RNG, health)."""
        def save() -> dict:
            return local_tensors({"weights": checkpointer.live_state(), "train": train_state()})

        def load(received: dict) -> None:
            checkpointer.load_live_state(lambda own: copy_into(own, received["weights"]))
            load_train_state(received["train"])
            say(f"replica group {self.group}: healed from a live peer at step {received['train']['step']}")

        self.manager.register_state_dict_fn("ember", load, save)

    def set_step(self, step: int) -> None:
        """The step the groups agree on: a resumed group's, so the quorum heals the ones behind it."""
        self.manager.load_state_dict({"step": step, "batches_committed": step * self.count})

    def start_step(self) -> None:
        """The step's quorum; a group behind its peers receives their state here (the registered loads run). The
        first step's is wait_for_groups' last quorum: its peers, in their step, wait for this group's reduction."""
        if self._first_quorum_done:
            self._first_quorum_done = False
            return
        self._quorum()

    def _quorum(self) -> None:
        self.manager.start_quorum()
        self.participants = self._quorum_groups()

    def wait_for_groups(self, say: Callable[[str], None]) -> None:
        """At the start of a process: quorums until every group is in one, for up to quorum_timeout_s (a group behind
        its peers heals here). torchft's lighthouse forms a quorum of whichever groups are up, so without this a group
        that starts first would train alone (or, with DiLoCo, the groups would never meet) until the others came up.
        After the timeout, training starts with the groups there (said in one line); DiLoCo refuses to."""
        deadline = time.monotonic() + self.cfg.quorum_timeout_s
        self._quorum()
        while len(self.participants) < self.count and time.monotonic() < deadline:
            if any(self._finished(g) for g in set(range(self.count)) - set(self.participants)):
                break  # (said below) a group that has ended never joins
            time.sleep(1.0)
            self._quorum()
        self._first_quorum_done = self.cfg.semi_sync == "none"  # (DiLoCo starts its own quorum at each sync)
        missing = sorted(set(range(self.count)) - set(self.participants))
        if missing and self.cfg.semi_sync == "diloco":
            raise ConfigError(f"replica group(s) {missing} did not join within fault_tolerance.quorum_timeout_s="
                              f"{self.cfg.quorum_timeout_s:g}: DiLoCo starts with every group; start them all (or "
                              "raise the timeout)")
        finished = [g for g in missing if self._finished(g)]
        if finished:  # they will never join: this group would end the run with other weights than theirs
            raise ConfigError(f"replica group(s) {finished} already finished this run (a checkpoint at max_steps="
                              f"{self.max_steps} in their run directories): group {self.group} would train without "
                              f"them to the end, to other weights; it stops here (their model: "
                              f"{group_dir(self._base_dir(), 0)}). Start the groups together, on enough nodes")
        if missing:
            say(f"replica group(s) {missing} not up after {self.cfg.quorum_timeout_s:g} s (fault_tolerance."
                f"quorum_timeout_s): training with groups {self.participants}; they heal when they join")

    def _base_dir(self) -> str:
        suffix = f"/replica-group-{self.group}"
        return self.run_dir[: -len(suffix)] if self.group and self.run_dir.endswith(suffix) else self.run_dir

    def _finished(self, group: int) -> bool:
        """Whether group `group`'s run holds a checkpoint at max_steps (it has ended, or is ending)."""
        from ember.checkpoint.run_dir import newest_step
        from ember.storage.location import as_path

        if not self.run_dir:
            return False
        step = newest_step(as_path(group_dir(self._base_dir(), group)) / "checkpoints")
        return step is not None and step >= self.max_steps

    def _quorum_groups(self) -> list[int]:
        """The groups in the step's quorum: torchft configures the cross-group process group with their global
        ranks (group x group size + rank) when the quorum changes."""
        ranks = getattr(self._pg, "_global_ranks", None)
        if ranks:
            return sorted({r // self._group_world for r in ranks})
        return list(range(self.manager.num_participants()))  # (a torchft without them: the count is right)

    def average(self, loss: torch.Tensor, params: Iterable[torch.nn.Parameter]) -> torch.Tensor:
        """Gradients (this rank's shards) and the loss averaged over the groups in the quorum, in one flat buffer
        per dtype; returns the averaged loss. A failed reduction leaves them for commit() to refuse."""
        params = [p for p in params if p.requires_grad]  # (LoRA's frozen base weights take no part)
        for p in params:  # one this group's batch did not reach: its zero share keeps every group's buffer aligned
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [_local(p.grad) for p in params]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        loss_buffer = loss.detach().reshape(1).to(torch.float32).clone()
        works = [(None, loss_buffer, self.manager.allreduce(loss_buffer))]
        for tensors in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in tensors])
            works.append((tensors, flat, self.manager.allreduce(flat)))
        for tensors, flat, work in works:
            work.wait()
            if tensors is not None:
                pieces = torch.split(flat, [t.numel() for t in tensors])
                torch._foreach_copy_(tensors, [piece.view_as(t) for piece, t in zip(pieces, tensors)])
        return loss_buffer[0]

    def commit(self) -> bool:
        """Whether every rank of every group in the quorum finished the step: only then does the optimizer step."""
        self.committed = self.manager.should_commit()
        return self.committed

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def diloco(replicas: ReplicaGroups, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
           resumed_from: Optional[Any] = None, world_size: int = 1) -> tuple[Any, torch.optim.Optimizer]:
    """torchft's DiLoCo over `model`'s weights, entered, and its outer optimizer: `optimizer` steps alone, and every
    diloco.sync_steps steps the groups average their pseudo-gradients and an outer SGD (Nesterov) steps. Its
    momentum comes back from the checkpoint `resumed_from` (outer_state); the weights it syncs against are the
    model's, since checkpoints fall on syncs."""
    from torchft.local_sgd import DiLoCo

    cfg = replicas.cfg.diloco
    outer = torch.optim.SGD(model.parameters(), lr=cfg.outer_lr, momentum=cfg.outer_momentum,
                            nesterov=cfg.nesterov and cfg.outer_momentum > 0)
    if resumed_from is not None:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        path = resumed_from / f"train-rank{rank}.pt"
        saved = {}
        if path.is_file():
            with path.open("rb") as file:
                saved = torch.load(file, weights_only=True)
        if saved.get("diloco_world") == world_size:
            params = [p for group in outer.param_groups for p in group["params"]]
            for param, buffer in zip(params, saved.get("diloco_outer_momentum") or []):
                if buffer is not None:
                    outer.state[param]["momentum_buffer"] = torch.zeros_like(param.detach())
                    _local(outer.state[param]["momentum_buffer"]).copy_(buffer)
    context = DiLoCo(replicas.manager, [model], optimizer, outer, sync_every=cfg.sync_steps,
                     backup_device=torch.device("cpu"), pin_memory=False)
    return context.__enter__(), outer


def outer_state(outer: Optional[torch.optim.Optimizer], world_size: int) -> dict[str, Any]:
    """DiLoCo's outer momentum (this rank's shards) for the checkpoint's train state; {} without DiLoCo. A resume at
    another world size restarts it from zero (the shards differ)."""
    if outer is None:
        return {}
    buffers = [outer.state[p].get("momentum_buffer") for group in outer.param_groups for p in group["params"]]
    return {"diloco_world": world_size,
            "diloco_outer_momentum": [None if b is None else _local(b).detach().clone() for b in buffers]}


def degraded_record(step: int, groups: list[int], count: int, tokens_per_step: int) -> dict[str, Any]:
    """metrics.jsonl's record of a step that ran with fewer than all replica groups: which groups' data it consumed
    (the others' rows of that global batch were skipped) and the tokens it really trained on."""
    return {"step": step, "replica_groups": groups, "replica_groups_missing": count - len(groups),
            "tokens": tokens_per_step * len(groups) // count}


def lighthouse_command(port: int, min_groups: int, join_timeout_ms: int = 30000) -> list[str]:
    """torchft's lighthouse on this host: the quorum service the groups join. A quorum waits up to join_timeout_ms
    for every live group to ask for it (longer than a step, or a group restarted mid-run could form one alone)."""
    return ["torchft_lighthouse", "--min_replicas", str(min_groups), "--quorum_tick_ms", "100",
            "--join_timeout_ms", str(join_timeout_ms), "--bind", f"[::]:{port}"]


__all__ = ["ReplicaGroups", "check", "diloco", "outer_state", "group_dir", "group_from_env", "lighthouse_command",
           "local_tensors", "copy_into", "replica_groups", "degraded_record"]
