"""XlaTrainer: ember/train.py's loop, with the step compiled by XLA over sharded jax arrays (ember/xla/step.py).

What it shares with the torch.distributed Trainer, unchanged: the run's decisions (run.resolve), the model
(run.build_model, on meta; its seeded init is the torch path's, weight for weight), the loaders and their
exact resume, the LR schedule (a torch LambdaLR whose value each step is an argument of the compiled step),
health checks, metrics, run.json, and checkpoints in ember's own format, written and read shard by shard by
each host (ember/xla/checkpoint.py): a TPU run's checkpoint is resumed, evaluated, generated from, converted to
Hugging Face and fine-tuned anywhere ember runs, and a torch run's resumes on TPU. The weights never sit whole
in a host's memory: the init fills one block at a time and sends it to the devices (layout.init_on_devices),
and a resume reads each host's chunks; only model.init_from's weights are loaded whole on each host first.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from rich.console import Console

from ember import run as run_lib
from ember.checkpoint import open_checkpoints, set_rng_state
from ember.config import JobConfig
from ember.data.loader import build_loader
from ember.data.tokenizer import build_tokenizer
from ember.errors import DataError
from ember.health import HealthGuard
from ember.metrics import print_header
from ember.nn import moe as moe_lib
from ember.optim import build_lr_scheduler, build_optimizer, restart_schedule
from ember.step import Batch
from ember.train import Trainer
from ember.xla import mesh as mesh_lib
from ember.xla import runtime
from ember.xla.checkpoint import DeviceState, RestoredState, XlaCheckpointManager
from ember.xla.layout import build_layout, init_on_devices, pick_compute_dtype, tied_aliases
from ember.xla.profiling import JaxStepProfiler


class XlaTrainer(Trainer):
    """The Trainer on jax devices (device=tpu|xla); see the module docstring."""

    def __init__(self, cfg: JobConfig, console: Optional[Console] = None):
        import jax

        self.cfg, self.console = cfg, console or Console(soft_wrap=True)
        devices = runtime.run_devices(cfg)
        self.rank, self.world_size = jax.process_index(), len(devices)
        self.is_main = self.rank == 0
        self.device = torch.device("cpu")  # the host: loaders, the host copy, signals
        self.output_dir = Path(cfg.output_dir)
        self.mesh = None  # no torch.distributed mesh: the jax Mesh is self.jax_mesh
        compute_dtype = pick_compute_dtype(cfg.precision, cfg.device)
        spec = run_lib.resolve(cfg, self.world_size, torch.device("cpu"), compute_dtype=compute_dtype)
        self.spec = dataclasses.replace(spec, device=torch.device("xla"))
        self.jax_mesh = mesh_lib.jax_mesh(spec.shape, devices)
        torch.manual_seed(cfg.seed)
        self.peak = _peak(cfg, devices[0].device_kind, compute_dtype)
        self.tokenizer = build_tokenizer(cfg.data, spec.args.vocab_size) if cfg.data.dataset != "synthetic" else None

        # The host model: the torch path's architecture, on meta. Its seeded init goes to the devices a piece at a
        # time (layout.init_on_devices: the torch path's values, never the whole model in host memory); only
        # model.init_from's weights are loaded whole on the host first.
        built = run_lib.build_model(dataclasses.replace(spec, device=torch.device("cpu")), None,
                                    materialize=bool(cfg.model.init_from))
        self.host_model = built.parts[0]
        self.model_parts, self.model = [self.host_model], self.host_model
        self.num_params = sum(p.numel() for p in built.whole.parameters())
        self.optimizer = build_optimizer(self.host_model, cfg.optim, "cpu")
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.schedule, cfg.max_steps)
        self.optimizer._opt_called = True  # the host optimizer never steps (the devices' does): no scheduler warning
        self.forward_backward = None

        # The traced model: another instance of the same architecture whose weights are the jax arrays.
        # Built on meta: only its RoPE tables are real (the step takes them as constants).
        traced = run_lib.build_model(dataclasses.replace(spec, device=torch.device("cpu")), None,
                                     materialize=False).parts[0]
        traced.init_rope(torch.device("cpu"))
        eos_id = self.tokenizer.eos_id if cfg.data.document_mask and self.tokenizer else None
        self.layout = build_layout(spec, self.jax_mesh, self.host_model, traced, compute_dtype, eos_id)
        self.names, self.tx, self.compiled = self.layout.names, self.layout.tx, self.layout.compiled
        self.param_shardings, self.opt_shardings = self.layout.param_shardings, self.layout.opt_shardings
        self.batch_sharding = self.layout.batch_sharding

        # Data: this host's rows of each global micro-batch (all of them on one host).
        hosts = jax.process_count()
        rows = cfg.micro_batch_size * spec.shape.dp
        loader_kwargs = dict(seq_len=cfg.seq_len, micro_batch_size=rows // hosts, dp_rank=self.rank, dp_world=hosts,
                             seed=cfg.seed, vocab_size=spec.args.vocab_size)
        self.train_loader = build_loader(cfg.data, self.tokenizer, split="train", **loader_kwargs)
        self.val_loader, val_note = None, None
        try:
            self.val_loader = build_loader(cfg.data, self.tokenizer, split="val", **loader_kwargs)
        except DataError as err:
            val_note = f"no validation: {err}"
        if self.is_main and cfg.metrics.console:
            mesh_note = f"xla: {len(devices)} {devices[0].device_kind} device(s), jax mesh {dict(self.jax_mesh.shape)}"
            print_header(self.console, self.spec, self.host_model, self.num_params, self.tokenizer, self.peak,
                         self.train_loader.describe(), [mesh_note, val_note])

        self.step = 0
        self.health = HealthGuard(cfg.max_skipped_steps, cfg.loss_spike_factor, self._say)
        device_state = DeviceState(self.names, self.layout.shapes, self.param_shardings, self.opt_shardings,
                                   tied_aliases(self.host_model), _param_groups(self.host_model, self.optimizer),
                                   lambda: (self.params, self.opt_state))
        self.checkpointer, state = open_checkpoints(
            self.spec, self.model_parts, self.host_model, self.optimizer, self._say,
            manager_type=functools.partial(XlaCheckpointManager, device_state=device_state))
        if state is not None:
            self.step = int(state["step"])
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
            restart_schedule(self.lr_scheduler)
            self.train_loader.load_state_dict(state["data"])
            set_rng_state(state["rng"])
            self.health.load_state_dict(state)
        self.params, self.opt_state = self._to_devices(self.checkpointer.restored)
        _weightless(self.host_model, self.optimizer)  # the devices hold the weights now: a stale copy would mislead

    # ---------------------------------------------------------------- host <-> devices
    def _to_devices(self, restored: Optional[RestoredState]) -> tuple[dict[str, Any], Any]:
        """The run's starting weights and optax state as sharded jax arrays: a resume's, or the host model's
        seeded init with a fresh optimizer."""
        import jax

        if restored is not None:
            params = restored.params
        elif not self.cfg.model.init_from:
            params = init_on_devices(self.host_model, self.cfg.seed, self.names, self.param_shardings)
        else:
            params = {}
            for name, hosts in self.names.items():
                tensors = [self.host_model.get_parameter(h).detach().numpy() for h in hosts]
                params[name] = jax.device_put(np.stack(tensors) if len(tensors) > 1 else tensors[0],
                                              self.param_shardings[name])
        if restored is None:
            return params, jax.device_put(self.tx.init(params), self.opt_shardings)
        # Resumed: torch AdamW's moments and step count become optax's, placed into optax's state without first
        # allocating fresh moments (the rest of its state is the decay mask's and scale's: no arrays to speak of).
        shapes = jax.eval_shape(self.tx.init, params)
        rest = jax.device_put(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes[1:]), self.opt_shardings[1:])
        count = jax.device_put(np.asarray(restored.count, dtype=np.int32), self.opt_shardings[0].count)
        return params, (shapes[0]._replace(count=count, mu=restored.mu, nu=restored.nu), *rest)

    # ---------------------------------------------------------------- one step
    def _global(self, micro_batches: list[Batch]) -> tuple[Any, Any]:
        """This host's rows of the micro-batches as global (micro-batches, B, T) jax arrays."""
        import jax

        inputs = np.stack([b[0].numpy() for b in micro_batches])
        labels = np.stack([b[1].numpy() for b in micro_batches])
        return (jax.make_array_from_process_local_data(self.batch_sharding, inputs),
                jax.make_array_from_process_local_data(self.batch_sharding, labels))

    def train_step(self, micro_batches: list[Batch]) -> tuple[float, float]:
        inputs, labels = self._global(micro_batches)
        lr = np.float32(self.optimizer.param_groups[0]["lr"])
        self.params, self.opt_state, loss, norm, counts, aux = self.compiled.train(
            self.params, self.opt_state, inputs, labels, lr)
        loss, norm = float(loss), float(norm)
        moes = self.host_model.moe_layers()
        if moes:  # the step's load and router losses, for the MoE metrics (nn/moe.py's bookkeeping)
            counts, aux = np.asarray(counts), np.asarray(aux)
            for i, moe in enumerate(moes):
                moe._step_loads = [torch.from_numpy(counts[i].astype(np.int64))]
                moe.aux_loss, moe.z_loss = (torch.tensor(float(v)) for v in aux[i])
            moe_lib.end_moe_step(self.host_model, 1)
        self.lr_scheduler.step()
        return loss, norm

    def evaluate(self) -> Optional[float]:
        if self.val_loader is None:
            return None
        self.val_loader.reset()
        val_iter = iter(self.val_loader)
        inputs, labels = self._global([next(val_iter) for _ in range(self.cfg.eval_batches * self.spec.grad_accum)])
        return float(self.compiled.evaluate(self.params, inputs, labels))

    def profiler(self) -> JaxStepProfiler:
        cfg = self.cfg
        return JaxStepProfiler(cfg.profile.enabled, cfg.profile.step, cfg.profile.steps, self.output_dir, self.rank,
                               self.device, self._say)

    def _metrics_record(self, loss: float, lr: float, grad_norm: float, window: dict) -> dict:
        """The torch path's record; on TPUs and GPUs its memory_gb is the devices' (the busiest local device's peak,
        from jax's allocator) and host_memory_gb the host process's. On jax's CPU backend both are host memory."""
        import jax

        record = super()._metrics_record(loss, lr, grad_norm, window)
        stats = [d.memory_stats() or {} for d in jax.local_devices()]
        peaks = [s["peak_bytes_in_use"] for s in stats if "peak_bytes_in_use" in s]
        if peaks:
            record["host_memory_gb"] = record["memory_gb"]
            record["memory_gb"] = max(peaks) / 2**30
        return record

    def eval_tasks(self) -> dict[str, float]:
        return {}  # eval.tasks is refused on this path (ember/xla/checks.py): `ember eval` the checkpoint

    def all_sum(self, value: torch.Tensor) -> torch.Tensor:
        return value  # the MoE metrics come back from the compiled step already global


def _peak(cfg: JobConfig, device_kind: str, dtype: torch.dtype) -> Any:
    """The MFU peak: a TPU's or GPU's datasheet peak (ember/hardware.py), or on jax's CPU backend this CPU's."""
    import jax

    from ember import hardware

    if cfg.device == "tpu":
        return hardware.tpu_peak_flops(device_kind, dtype, cfg.metrics.peak_tflops)
    if jax.default_backend() == "gpu":  # device=xla on jax's CUDA/ROCm backend: the GPU's datasheet row
        return hardware.named_peak_flops(device_kind, dtype, cfg.metrics.peak_tflops)
    peak = hardware.peak_flops(torch.device("cpu"), dtype, cfg.metrics.peak_tflops)
    local = jax.local_device_count()
    if device_kind != "cpu" or local == 1 or peak.value_flops is None or cfg.metrics.peak_tflops is not None:
        return peak
    # jax's virtual CPU devices share this machine's cores: each device's peak is its share of the measured one
    # (not raised by a run: the cache holds the whole machine's)
    return dataclasses.replace(peak, value_flops=peak.value_flops / local, measured=False,
                               source=f"{peak.source}, shared by {local} virtual jax CPU devices")


def run(cfg: JobConfig) -> dict:
    """`ember train ... device=tpu|xla`."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return XlaTrainer(cfg).train()


def _param_groups(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The optimizer's param groups as torch's optimizer state dict names them (hyper-parameters, fqns)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [{**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(p)] for p in group["params"]]}
            for group in optimizer.param_groups]


def _weightless(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> torch.nn.Module:
    """The model with its parameters on the meta device (names, shapes and ties kept; buffers kept), and the
    optimizer's groups pointing at them, so that nothing holds the host weights."""
    meta: dict[int, torch.nn.Parameter] = {}

    def swap(param: torch.nn.Parameter) -> torch.nn.Parameter:
        return meta.setdefault(id(param), torch.nn.Parameter(torch.empty_like(param, device="meta"),
                                                             requires_grad=param.requires_grad))

    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                module._parameters[name] = swap(param)
    for group in optimizer.param_groups if optimizer is not None else []:
        group["params"] = [swap(param) for param in group["params"]]
    return model
