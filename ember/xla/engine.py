"""The XLA SPMD engine (device=tpu|xla): the step compiled by XLA over weights and optimizer state held as sharded
jax arrays (ember/xla/step.py), behind the interface ember/train/torch_engine.py's TorchEngine has.

What it shares with the torch engine through ember/train/trainer.py's Trainer, unchanged: the run's decisions
(run.resolve), the model (run.build_model, on meta; its seeded init is the torch path's, weight for weight), the
loaders and their exact resume, the LR schedule (a torch LambdaLR whose value each step is an argument of the
compiled step), health checks, metrics, the header, run.json, and checkpoints in ember's own format, written and
read shard by shard by each host (ember/xla/checkpoint.py): a TPU run's checkpoint is resumed, evaluated, generated
from, converted to Hugging Face and fine-tuned anywhere ember runs, and a torch run's resumes on TPU. The weights
never sit whole in a host's memory: the init fills one block at a time and sends it to the devices
(layout.init_on_devices), and a resume reads each host's chunks; only model.init_from's weights are loaded whole on
each host first.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from ember.config_schema import JobConfig
from ember.data.tokenizer import AnyTokenizer
from ember.eval.distributed import EvalRanks
from ember.hardware.peaks import PeakFlops
from ember.nn.moe_stats import MoEStats
from ember.train import run as run_lib
from ember.train.optim import build_optimizer
from ember.train.run import RunSpec
from ember.train.step import Batch
from ember.xla import mesh as mesh_lib, runtime
from ember.xla.checkpoint import DeviceState, RestoredState, XlaCheckpointManager
from ember.xla.layout import init_on_devices, layout_for, tied_aliases
from ember.xla.profiling import JaxStepProfiler


class XlaEngine:
    """This host's part of a jax SPMD job; see the module docstring."""

    replicas = None  # no torchft replica groups (fault_tolerance.enable is refused on XLA)
    diloco_outer = None  # (nor DiLoCo)

    def __init__(self, cfg: JobConfig):
        import jax

        self.cfg = cfg
        self.devices = runtime.run_devices(cfg)
        self.rank, self.world_size = jax.process_index(), len(self.devices)
        self.device = torch.device("cpu")  # the host: loaders, the host model, signals
        self.run_device = torch.device("xla")  # what the run's decisions and run.json name
        self.mesh = None  # no torch.distributed DeviceMesh: the jax Mesh is self.jax_mesh
        self.dpo = None  # task=dpo is refused on this engine (ember/xla/checks.py)
        self.notes: list[Optional[str]] = []

    def connect(self, spec: RunSpec) -> None:
        """The jax Mesh of `spec`'s layout over this run's devices."""
        self.spec = spec
        self.jax_mesh = mesh_lib.jax_mesh(spec.shape, self.devices)
        self.notes.append(f"xla: {len(self.devices)} {self.devices[0].device_kind} device(s), "
                          f"jax mesh {dict(self.jax_mesh.shape)}")

    def peak(self) -> PeakFlops:
        return _peak(self.cfg, self.devices[0].device_kind, self.spec.compute_dtype)

    def build(self, tokenizer: Optional[AnyTokenizer]) -> None:
        """The host model (the torch path's architecture, on meta; materialised only for model.init_from's weights),
        its optimizer (the LR schedule's and the checkpoints' view of the parameter groups), and the layout: the
        traced model, shardings, optax and the compiled step."""
        cfg, spec = self.cfg, self.spec
        built = run_lib.build_model(dataclasses.replace(spec, device=torch.device("cpu")), None,
                                    materialize=bool(cfg.model.init_from))
        self.model = built.parts[0]
        self.model_parts, self.whole = [self.model], built.whole
        self.moe_stats = MoEStats()  # the host model's MoE layers, as the compiled step reports them
        self.optimizer = build_optimizer(self.model, cfg.optim, "cpu")
        eos_id = tokenizer.eos_id if cfg.data.document_mask and tokenizer else None
        self.layout = layout_for(spec, self.jax_mesh, self.model, eos_id)

    def data_shard(self) -> tuple[int, int, int]:
        """(rows, host, hosts): this host's rows of each global micro-batch (all of them on one host)."""
        import jax

        hosts = jax.process_count()
        return self.cfg.micro_batch_size * self.spec.shape.dp // hosts, self.rank, hosts

    def checkpoint_manager(self, *args: Any, **kwargs: Any) -> XlaCheckpointManager:
        """ember/checkpoint/manager.py's manager over the sharded device arrays (each host its own chunks)."""
        layout = self.layout
        device_state = DeviceState(layout.names, layout.shapes, layout.param_shardings, layout.opt_shardings,
                                   tied_aliases(self.model), _param_groups(self.model, self.optimizer),
                                   lambda: (self.params, self.opt_state))
        return XlaCheckpointManager(*args, device_state=device_state, **kwargs)

    def place(self, checkpointer: XlaCheckpointManager) -> None:
        """The run's starting weights and optax state as sharded jax arrays (what a resume restored, or the host
        model's seeded init with a fresh optimizer); then the host's parameters are released: the devices hold the
        weights."""
        self.params, self.opt_state = self._to_devices(checkpointer.restored)
        _release_host_weights(self.model)

    def _to_devices(self, restored: Optional[RestoredState]) -> tuple[dict[str, Any], Any]:
        import jax

        layout = self.layout
        if restored is not None:
            params = restored.params
        elif not self.cfg.model.init_from:
            params = init_on_devices(self.model, self.cfg.seed, layout.names, layout.param_shardings)
        else:
            params = {}
            for name, hosts in layout.names.items():
                tensors = [self.model.get_parameter(h).detach().numpy() for h in hosts]
                params[name] = jax.device_put(np.stack(tensors) if len(tensors) > 1 else tensors[0],
                                              layout.param_shardings[name])
        if restored is None:
            return params, jax.device_put(layout.tx.init(params), layout.opt_shardings)
        # Resumed: torch AdamW's moments and step count become optax's, placed into optax's state without first
        # allocating fresh moments (the rest of its state is the decay mask's and scale's: no arrays to speak of).
        shapes = jax.eval_shape(layout.tx.init, params)
        rest = jax.device_put(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes[1:]), layout.opt_shardings[1:])
        count = jax.device_put(np.asarray(restored.count, dtype=np.int32), layout.opt_shardings[0].count)
        return params, (shapes[0]._replace(count=count, mu=restored.mu, nu=restored.nu), *rest)

    # ---------------------------------------------------------------- one step
    def _global(self, micro_batches: list[Batch]) -> tuple[Any, Any]:
        """This host's rows of the micro-batches as global (micro-batches, B, T) jax arrays."""
        import jax

        inputs = np.stack([b[0].numpy() for b in micro_batches])
        labels = np.stack([b[1].numpy() for b in micro_batches])
        sharding = self.layout.batch_sharding
        return (jax.make_array_from_process_local_data(sharding, inputs),
                jax.make_array_from_process_local_data(sharding, labels))

    def train_step(self, micro_batches: list[Batch]) -> tuple[float, float]:
        """The compiled step: forward, backward, accumulation, clipping and AdamW on the devices. The host
        optimizer is stepped too, over parameters without gradients (it changes nothing): the LR schedule reads
        it as stepped, and the value the compiled step takes is its group's lr."""
        inputs, labels = self._global(micro_batches)
        lr = np.float32(self.optimizer.param_groups[0]["lr"])
        self.params, self.opt_state, loss, norm, counts, aux = self.layout.compiled.train(
            self.params, self.opt_state, inputs, labels, lr)
        loss, norm = float(loss), float(norm)
        moes = self.model.moe_layers()
        if moes:  # the step's load and router losses, for the MoE metrics (the engine's collector, nn/moe_stats.py)
            self.moe_stats.record_step(moes, np.asarray(counts), np.asarray(aux))
        self.optimizer.step()
        return loss, norm

    def evaluate(self, micro_batches: list[Batch]) -> Optional[float]:
        inputs, labels = self._global(micro_batches)
        return float(self.layout.compiled.evaluate(self.params, inputs, labels))

    def scoring_model(self) -> tuple[nn.Module, EvalRanks]:
        """eval.tasks' model: the compiled logits function over the devices' weights (one jax program spans every
        device, so the requests are not shared out: every host scores them all, alike)."""
        return XlaScoringModel(self), EvalRanks()

    def all_sum(self, value: torch.Tensor) -> torch.Tensor:
        """The MoE metrics come back from the compiled step already summed over every device."""
        return value

    def device_memory(self, record: dict[str, Any]) -> None:
        """On TPUs and GPUs memory_gb is the devices' (the busiest local device's peak, from jax's allocator) and
        host_memory_gb the host process's. On jax's CPU backend both are host memory."""
        import jax

        stats = [d.memory_stats() or {} for d in jax.local_devices()]
        peaks = [s["peak_bytes_in_use"] for s in stats if "peak_bytes_in_use" in s]
        if peaks:
            record["host_memory_gb"] = record["memory_gb"]
            record["memory_gb"] = max(peaks) / 2**30

    def profiler(self, output_dir: Any, say: Any) -> JaxStepProfiler:
        cfg = self.cfg
        return JaxStepProfiler(cfg.profile.enabled, cfg.profile.step, cfg.profile.steps, output_dir, self.rank,
                               self.device, say)

    def window_metrics(self, record: dict[str, Any]) -> dict[str, Any]:
        return {}


class XlaScoringModel(nn.Module):
    """`model(tokens, logits_at=index)` as ember/eval/scoring.py calls it, computed by the engine's compiled logits
    function (layout.compiled.logits) over the sharded weights. Rows, tokens and positions are padded to powers of
    two (rows to at least eval.batch_size's) so that a task compiles a few programs, not one per batch: right
    padding changes no earlier position of a causal model, and the padding's logits are cut off."""

    def __init__(self, engine: XlaEngine):
        super().__init__()
        self.args = engine.spec.args
        self.compiled, self.params = engine.layout.compiled, engine.params
        self.rows = engine.cfg.eval.batch_size

    def forward(self, tokens: torch.Tensor, logits_at: Optional[torch.Tensor] = None) -> torch.Tensor:
        rows, length = tokens.shape
        index = (torch.arange(length).expand(rows, length) if logits_at is None else logits_at).cpu()
        padded_rows = max(_power_of_two(rows), self.rows)
        padded_length = min(_power_of_two(length), self.args.max_seq_len)
        padded_tokens = np.zeros((padded_rows, padded_length), np.int32)
        padded_tokens[:rows, :length] = tokens.cpu().numpy()
        padded_index = np.zeros((padded_rows, _power_of_two(index.shape[1])), np.int32)
        padded_index[:rows, :index.shape[1]] = index.numpy()
        logits = np.asarray(self.compiled.logits(self.params, padded_tokens, padded_index))
        return torch.from_numpy(logits[:rows, :index.shape[1]].copy())


def _power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _peak(cfg: JobConfig, device_kind: str, dtype: torch.dtype) -> PeakFlops:
    """The MFU peak: a TPU's or GPU's datasheet peak (ember/hardware/peaks.py), or on jax's CPU backend this CPU's."""
    import jax

    from ember.hardware import peaks as hardware

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


def _param_groups(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The optimizer's param groups as torch's optimizer state dict names them (hyper-parameters, fqns)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [{**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(p)] for p in group["params"]]}
            for group in optimizer.param_groups]


def _release_host_weights(model: nn.Module) -> None:
    """Every parameter of the host model becomes a meta tensor in place (torch.utils.swap_tensors: the modules, tied
    aliases and the optimizer's groups keep the same objects, names and shapes; buffers stay), so that nothing holds
    a stale copy of the weights the devices now train."""
    for param in model.parameters():  # each tied parameter once
        torch.utils.swap_tensors(param, nn.Parameter(torch.empty_like(param, device="meta"),
                                                     requires_grad=param.requires_grad))

