"""A run, resolved and assembled in one place: `ember train`, `ember plan`, `ember eval` (on a mesh) and the
DPO reference all go through here, so what the plan models is what the trainer builds (a rule copied into
each caller drifted within a day).

- `resolve(cfg, world_size, device) -> RunSpec`: every decision that follows from the config and the machine
  (the mesh, the model's architecture, compute dtype, FSDP mixed precision, loss parallelism, the context-
  parallel implementation, FP8, gradient accumulation, pipeline stages, FLOPs per token), frozen; the run
  header prints it and run.json records it.
- `build_model(spec, mesh)`: model on meta -> pipeline split -> `parallelize` -> to_empty -> random init ->
  model.init_from -> LoRA adapters' init. The planner stops after `parallelize` (its tensors are fake).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from ember import config as config_lib
from ember.checkpoint.run_dir import resumed_compute
from ember.config_schema import JobConfig
from ember.errors import ConfigError, EmberError
from ember.finetune import base_fingerprint, lora as lora_lib
from ember.hardware import cpu_rates
from ember.hardware.device import PrecisionChoice, choose_compute_dtype
from ember.models import MODELS, ModelSpec
from ember.models.choice import ModelChoice, resolve_model
from ember.nn.args import DecoderArgs
from ember.nn.decoder import has_local_attention
from ember.nn.loss import output_chunks
from ember.nn.moe_stats import MoEOptions
from ember.parallel.ep import expert_dispatch
from ember.parallel.mesh import ParallelMesh
from ember.parallel.mesh_shape import MeshShape
from ember.parallel.parallelize import ParallelOptions
from ember.storage.location import check_locations, is_url
from ember.train import engines, fault_tolerance
from ember.train.engines import mesh_shape


def uses_loss_parallel(cfg: JobConfig, shape: MeshShape) -> bool:
    """Cross-entropy on vocabulary-sharded logits: with tensor > 1 and parallel.loss_parallel, never with a
    pipeline, nor for task=dpo|grpo (which read each token's log-probability from whole logits)."""
    return (shape.degree("tensor") > 1 and cfg.parallel.loss_parallel and shape.degree("pipeline") == 1
            and cfg.task == "lm")


def uses_fsdp_mixed_precision(cfg: JobConfig, shape: MeshShape, compute_dtype: torch.dtype) -> bool:
    """FSDP's mixed precision (low-precision parameters, fp32 gradient reduction) instead of autocast: where
    FSDP reduces gradients over more than one rank, parallel.mixed_precision is on, and compute is not fp32."""
    return shape.grad_sync > 1 and cfg.parallel.mixed_precision and compute_dtype != torch.float32


def load_config(recipe: str = "debug", overrides: Optional[list[str]] = None,
                world_size: Optional[int] = None) -> JobConfig:
    """Recipe + `key=value` overrides -> the JobConfig a command runs: merged and type-checked by ember.config,
    the family taken from model.init_from's source, then every feature's checks (`check`), before any work.
    world_size: the devices the run spans; None: this machine's (one process, or with device=tpu|xla every jax
    device of every host)."""
    overrides = list(overrides or [])
    cfg = config_lib.load(recipe, overrides)
    check_locations(cfg)  # before anything is read from, or written to, a location the run names
    if world_size is None:
        world_size = engines.rules(cfg.device).world_size(cfg)
    if cfg.model.init_from and not any(item.startswith("model.family=") for item in overrides):
        cfg.model.family = _init_from_family(cfg.model.family, cfg.model.init_from)
    check(cfg, world_size)
    return cfg


def check(cfg: JobConfig, world_size: int) -> None:
    """The checks that need a feature's code, each with its feature: data sources, eval tasks, chat data, the
    mesh and batch against the world, the model's architecture (model.init_from's read, not loaded), the
    parallel layout against it, and LoRA. Each is one ConfigError naming the keys."""
    from ember.data import chat, sources
    from ember.eval import tasks
    from ember.finetune import checks as finetune_checks

    sources.check(cfg)
    finetune_checks.check(cfg)
    tasks.check(cfg)
    chat.check(cfg)
    fault_tolerance.check(cfg)
    shape = engines.rules(cfg.device).layout(cfg, world_size)  # with what the engine does not run, refused first
    check_batch(cfg, shape)
    check_model(cfg, shape)


def check_model(cfg: JobConfig, shape: MeshShape) -> None:
    """The model's hyper-parameters (model.init_from's architecture, read) against seq_len, the layout and LoRA."""
    from ember.parallel import checks as parallel_checks

    args = model_choice(cfg).args
    if cfg.seq_len > args.max_seq_len:
        raise ConfigError(f"seq_len={cfg.seq_len} exceeds the model's max_seq_len={args.max_seq_len} "
                          f"({cfg.model.family} {cfg.model.flavor}); lower seq_len or set model.max_seq_len")
    parallel_checks.check(cfg, shape, args)
    engines.rules(cfg.device).check_model(cfg, shape, args)
    if cfg.lora.rank:
        lora_lib.check_lora(cfg.lora, cfg.model.family, args, cfg.model.init_from)


def _init_from_family(recipe_family: str, init_from: str) -> str:
    """With model.init_from the architecture is the source's, its family too: a recipe's model.family is a default
    that the source replaces. One given on the command line is kept, and refused if it contradicts the source."""
    from ember.models.choice import source_family

    if not is_url(init_from) and not Path(init_from).expanduser().exists():  # model_choice says so, after the
        # checks that need no source
        return recipe_family
    try:
        return source_family(recipe_family, init_from)
    except EmberError as err:
        raise ConfigError(str(err)) from None


def check_batch(cfg: JobConfig, shape: MeshShape) -> None:
    """global_batch_size against micro_batch_size x the data-parallel ranks of every replica group (the accumulation is
    their ratio)."""
    from ember.finetune.checks import check_rollout_layout

    dp = shape.dp * fault_tolerance.replica_groups(cfg)
    check_rollout_layout(cfg, dp)
    per_step = cfg.micro_batch_size * dp
    if cfg.global_batch_size % per_step:
        groups = " (over fault_tolerance.replica_groups)" if dp != shape.dp else ""
        raise ConfigError(
            f"global_batch_size={cfg.global_batch_size} is not divisible by micro_batch_size x data-parallel size"
            f"{groups} = {cfg.micro_batch_size} x {dp} = {per_step}; change global_batch_size or micro_batch_size")


def model_choice(cfg: JobConfig) -> ModelChoice:
    """The run's model (family, flavor, args, source): the recipe's flavor with the model.* overrides, or with
    model.init_from the source's architecture (read, not loaded)."""
    try:
        return resolve_model(cfg.model.family, cfg.model.flavor, config_lib.model_overrides(cfg.model),
                             cfg.model.init_from)
    except ConfigError:
        raise
    except EmberError as err:
        raise ConfigError(str(err)) from None


@dataclass(frozen=True)
class RunSpec:
    """Every decision about a run, made once by `resolve`. `device` is the device the steps run on (for the
    planner, the type of its target device)."""

    cfg: JobConfig
    world_size: int
    device: torch.device
    shape: MeshShape
    flavor: str  # the flavor label (with model.init_from, the source's)
    args: DecoderArgs  # the model's hyper-parameters (the family's args dataclass)
    architecture_from: Optional[str]  # model.init_from's description file, where the architecture came from
    compute_dtype: torch.dtype
    fsdp_mixed: bool
    parallel: ParallelOptions
    grad_accum: int
    num_stages: int  # pipeline stages over all ranks (1 without a pipeline)
    pp_microbatches: int  # pipeline micro-batches per micro-batch (1 without a pipeline)
    output_chunks: int  # the forward's logits in this many sequence chunks (whole-sequence logits only)
    # The loss fused with the output projection, `output_chunks` row chunks at a time, so a micro-batch's logits
    # are never all in memory (ember.nn.loss.linear_cross_entropy_sum): on one process (FSDP's head unit
    # expects its output projection's own forward to run), whole-sequence logits, not DPO (which reads logits).
    fused_output: bool
    flops_per_token: float  # training FLOPs per token as MFU counts them (LoRA, DPO included)
    # why precision=auto chose the compute dtype on a CPU (the header's line): words about a decision, not one
    precision_note: Optional[str] = field(default=None, compare=False)

    @property
    def family(self) -> str:
        return self.cfg.model.family

    @property
    def model(self) -> ModelSpec:
        return MODELS[self.cfg.model.family]

    def degree(self, axis: str) -> int:
        return self.shape.degree(axis)

    @property
    def autocast_dtype(self) -> Optional[torch.dtype]:
        """Autocast's dtype, or None: fp32 compute, or FSDP's mixed precision casting instead."""
        return None if self.compute_dtype == torch.float32 or self.fsdp_mixed else self.compute_dtype

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step; for DPO both rows of each pair."""
        return self.cfg.global_batch_size * self.cfg.seq_len * (2 if self.cfg.task == "dpo" else 1)

    def describe(self) -> dict[str, Any]:
        """The decisions as run.json records them."""
        par = self.parallel
        return {"mesh": self.shape.describe(), "world_size": self.world_size, "device": str(self.device),
                "compute_dtype": str(self.compute_dtype).replace("torch.", ""), "fsdp_mixed_precision": self.fsdp_mixed,
                "loss_parallel": par.loss_parallel, "cp_impl": par.cp_impl, "fp8": par.fp8_recipe,
                "grad_accum": self.grad_accum, "pipeline_stages": self.num_stages,
                # a count of FLOPs: an int whatever the family (a local span's mean key count makes a float)
                "pp_microbatches": self.pp_microbatches, "flops_per_token": round(self.flops_per_token),
                "fused_output_loss": self.fused_output, "output_chunks": self.output_chunks}


def resolve(cfg: JobConfig, world_size: int, device: torch.device,
            compute_dtype: Optional[torch.dtype] = None) -> RunSpec:
    """The RunSpec of `cfg` on `world_size` processes of `device`. `compute_dtype`: the planner's, for a device
    this machine may not have (its hardware table decides); None: picked for `device`, this machine's, against
    which the options that need a kind of device are checked (one line each, before any work)."""
    shape = mesh_shape(cfg, world_size)
    choice = model_choice(cfg)
    note = None
    if compute_dtype is None:
        precision = choose_precision(cfg, device, choice.args)
        compute_dtype, note = precision.dtype, precision.training_note()
        if engines.rules(cfg.device).torch_device_checks:
            check_device_options(cfg, shape, device, choice.args)
    flops = lora_lib.run_flops_per_token(cfg, MODELS[cfg.model.family], choice.args, compute_dtype)
    return _decide(cfg, world_size, device, shape, choice.flavor, choice.args, choice.source, compute_dtype, flops,
                   note)


def choose_precision(cfg: JobConfig, device: torch.device, args: Any) -> PrecisionChoice:
    """What cfg.precision means on `device` for the model of `args` (ember.hardware.device.choose_compute_dtype): on a
    CPU with bf16 instructions, measured at this model's training GEMMs on a micro-batch's tokens."""
    def gemms() -> list[cpu_rates.Gemm]:
        with torch.device("meta"):
            model = MODELS[cfg.model.family].model_cls(args)
        return cpu_rates.model_gemms(model, cfg.micro_batch_size * cfg.seq_len)

    trained = resumed_compute(cfg.resume, cfg.output_dir) if cfg.precision == "auto" else None
    if trained is not None:
        # A resumed run keeps the dtype its steps computed in: a measurement taken again (another machine, a busy
        # one) must not switch it halfway, nor refuse the plain resume.
        return PrecisionChoice(getattr(torch, trained), "kept from the run this resumes, run.json's compute: not "
                                                        "measured again")
    engine_dtype = engines.rules(cfg.device).compute_dtype
    if engine_dtype is not None:
        return PrecisionChoice(engine_dtype(cfg.precision, cfg.device))
    return choose_compute_dtype(cfg.precision, device, gemms)


def respecify(spec: RunSpec, cfg: JobConfig) -> RunSpec:
    """`spec`'s decisions for `cfg`, a variant of spec.cfg with the same model, mesh and FLOPs per token (the
    planner's trials of micro-batch sizes and remat policies)."""
    return _decide(cfg, spec.world_size, spec.device, spec.shape, spec.flavor, spec.args, spec.architecture_from,
                   spec.compute_dtype, spec.flops_per_token, spec.precision_note)


def _decide(cfg: JobConfig, world_size: int, device: torch.device, shape: MeshShape, flavor: str, args: Any,
            architecture_from: Optional[str], compute_dtype: torch.dtype, flops_per_token: float,
            precision_note: Optional[str]) -> RunSpec:
    fsdp_mixed = uses_fsdp_mixed_precision(cfg, shape, compute_dtype)
    parallel = ParallelOptions(
        compile=cfg.compile, remat=cfg.model.remat, remat_every=cfg.model.remat_every,
        param_dtype=compute_dtype if fsdp_mixed else None, reduce_dtype=torch.float32 if fsdp_mixed else None,
        reshard_after_forward=cfg.parallel.reshard_after_forward, cpu_offload=cfg.parallel.cpu_offload,
        loss_parallel=uses_loss_parallel(cfg, shape), cp_impl=cp_implementation(cfg, device, args),
        # flex attention's block masks skip what documents and local spans hide; under context parallelism the
        # all-gather form applies the spans (document masking is refused there)
        flex_attention=(cfg.data.document_mask or has_local_attention(args)) and device.type == "cuda"
        and shape.degree("context") == 1,
        fp8_recipe=cfg.fp8.recipe if config_lib.fp8_enabled(cfg) else None, fp8_emulate=cfg.fp8.emulate)
    pp = shape.degree("pipeline")
    num_stages = pp * cfg.parallel.pp_stages_per_rank if pp > 1 else 1
    pp_microbatches = 1 if pp == 1 else (cfg.micro_batch_size if cfg.parallel.pp_microbatches == -1
                                         else cfg.parallel.pp_microbatches)
    # Plain-tensor logits of the whole sequence (no tensor or pipeline split) are computed in chunks; the XLA path's
    # loss is one traced function of the micro-batch's whole logits (ember/xla/step.py), which `ember plan` counts.
    whole_logits = shape.degree("tensor") > 1 or pp > 1 or engines.rules(cfg.device).whole_logits
    fused_output = not whole_logits and world_size == 1 and cfg.task == "lm"
    chunks = 1 if whole_logits else output_chunks(cfg.micro_batch_size, cfg.seq_len // shape.degree("context"),
                                                  args.vocab_size, device.type, fused=fused_output)
    grad_accum = config_lib.grad_accum_steps(cfg, shape.dp * fault_tolerance.replica_groups(cfg))
    return RunSpec(cfg=cfg, world_size=world_size, device=device, shape=shape, flavor=flavor, args=args,
                   architecture_from=architecture_from, compute_dtype=compute_dtype, fsdp_mixed=fsdp_mixed,
                   parallel=parallel, grad_accum=grad_accum, num_stages=num_stages,
                   pp_microbatches=pp_microbatches, output_chunks=chunks, flops_per_token=flops_per_token,
                   fused_output=fused_output, precision_note=precision_note)


def cp_implementation(cfg: JobConfig, device: torch.device, args: Any) -> str:
    """parallel.cp_impl, with auto meaning ring attention on CUDA and the all-gather form elsewhere, and for a
    model with sliding-window or chunked layers (ring attention runs SDPA's plain causal form)."""
    if cfg.parallel.cp_impl != "auto":
        return cfg.parallel.cp_impl
    return "ring" if device.type == "cuda" and not has_local_attention(args) else "allgather"


def check_device_options(cfg: JobConfig, shape: MeshShape, device: torch.device, args: Any) -> None:
    """The options that need a kind of device (or model), against the one the run has."""
    from ember.parallel import fp8 as fp8_lib

    if config_lib.fp8_enabled(cfg):
        fp8_lib.check_fp8_device(device, cfg.fp8.emulate)
    if shape.degree("context") > 1 and getattr(args, "attn_softcap", None) is not None:
        raise ConfigError(f"{cfg.model.family} soft-caps its attention scores, which context parallelism's kernels do "
                          "not; use ici_mesh.context=1 (shard the sequence's work with fsdp or tensor instead)")
    if shape.degree("context") > 1 and cp_implementation(cfg, device, args) == "ring":
        if device.type != "cuda":
            raise ConfigError("parallel.cp_impl=ring needs CUDA (SDPA's CPU kernel has no ring form); use allgather")
        if has_local_attention(args):
            raise ConfigError(f"parallel.cp_impl=ring runs plain causal attention, and {cfg.model.family} has "
                              "sliding-window or chunked layers; use parallel.cp_impl=allgather (or auto)")
    if cfg.parallel.cpu_offload and (device.type != "cuda" or shape.grad_sync == 1):
        raise ConfigError("parallel.cpu_offload moves FSDP-sharded parameters and optimizer state from the GPU "
                          "to host memory; it needs device=cuda and a data/fsdp axis > 1 "
                          "(on CPU they are already there)")


@dataclass
class BuiltModel:
    """This rank's part of the model: its (pipeline stage id, module) pairs, and the whole model on meta (for
    counts that are the whole model's, not a stage's)."""

    stages: list[tuple[int, nn.Module]]
    whole: nn.Module

    @property
    def parts(self) -> list[nn.Module]:
        return [part for _, part in self.stages]


def build_model(spec: RunSpec, mesh: Optional[ParallelMesh], *, stage_ids: Optional[list[int]] = None,
                args: Any = None, num_stages: Optional[int] = None, materialize: bool = True,
                random_init: bool = True, init_from: Optional[str] = None,
                moe: MoEOptions = MoEOptions()) -> BuiltModel:
    """Build this rank's part of the model as `spec` says, on `mesh` (an ember.parallel.mesh.ParallelMesh, or
    None for one device).

    stage_ids: the pipeline stages to build (default: this rank's by its pipeline coordinate); `args` and
    `num_stages` build another model the same way (the planner's models cut to a few layers). materialize=False
    stops after `parallelize`, on meta. random_init=False skips the seeded init where every weight comes from
    `init_from` (default: model.init_from), which is loaded resharded to the layout, then LoRA's adapters are
    initialised. `moe`: what the MoE layers are built with (the engine's router-loss weights and statistics
    collector, nn/moe_stats.py); under expert parallelism their dispatch is the expert axis's all-to-all."""
    from ember.model_io.load import load_weights
    from ember.parallel import pp as pp_lib
    from ember.parallel.parallelize import init_weights, parallelize

    cfg, model = spec.cfg, spec.model
    args = args or spec.args
    num_stages = num_stages or spec.num_stages
    if moe.dispatch is None and mesh is not None:
        moe = dataclasses.replace(moe, dispatch=expert_dispatch(mesh.submesh("expert")))
    with torch.device("meta"):
        # the families without experts take no MoE options
        whole = model.model_cls(args, moe=moe) if args.has_experts else model.model_cls(args)
    if stage_ids is None:
        stage_ids = ([0] if num_stages == 1 else pp_lib.stage_ids(mesh.coordinate("pipeline"), spec.degree("pipeline"),
                                                                  cfg.parallel.pp_stages_per_rank))
    stages = ([(sid, pp_lib.split_model(whole, sid, num_stages)) for sid in stage_ids] if num_stages > 1
              else [(0, whole)])
    lora = lora_lib.lora_transform(cfg, spec.compute_dtype)
    for _, part in stages:
        parallelize(part, mesh, model.tp_plan, spec.parallel, lora=lora)
    built = BuiltModel(stages, whole)
    if not materialize:
        return built
    for part in built.parts:
        # With CPU offload FSDP keeps the sharded parameters in host memory and moves them itself.
        part.to_empty(device="cpu" if spec.parallel.cpu_offload else spec.device)
        part.tie_weights()  # to_empty gives each module its own Parameter
    if random_init:
        def build_on_meta() -> nn.Module:
            with torch.device("meta"):
                return model.model_cls(args)

        init_weights(built.parts, build_on_meta, cfg.seed, spec.device, mesh is not None)
    else:
        for part in built.parts:
            part.init_rope(spec.device)
    init_from = init_from or cfg.model.init_from
    if init_from:  # on resume, the base of a LoRA or DPO checkpoint: a failure says so
        resumed = (base_fingerprint.resumed_base(cfg.resume, cfg.output_dir, init_from) if random_init
                   else contextlib.nullcontext())
        with resumed:
            load_weights(built.parts, init_from)
    if lora is not None:
        lora_lib.init_lora(built.parts, cfg.seed)
    return built

