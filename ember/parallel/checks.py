"""The parallel layout's checks: the mesh degrees and parallel.* keys against the model and the config, each a
one-line ConfigError naming the keys, before any work."""

from __future__ import annotations

from typing import Any

from ember.config_schema import JobConfig
from ember.errors import ConfigError, not_one_of
from ember.parallel.ac import POLICIES as REMAT_POLICIES
from ember.parallel.mesh_shape import MeshShape
from ember.parallel.pp import SCHEDULES as PP_SCHEDULES


def check(cfg: JobConfig, shape: MeshShape, args: Any) -> None:
    """The mesh and the parallel.* keys against the model (`args`, its hyper-parameters) and the rest of the
    config: each refusal names the keys to change (ember.train.run.load_config calls this, before any work)."""
    if cfg.model.remat not in REMAT_POLICIES:
        raise not_one_of("model.remat", cfg.model.remat, REMAT_POLICIES)
    par = cfg.parallel
    tp, pp, cp = shape.degree("tensor"), shape.degree("pipeline"), shape.degree("context")
    ep = shape.degree("expert")
    n_experts = getattr(args, "n_experts", None)
    if ep > 1 and not n_experts:
        raise ConfigError(
            f"expert parallelism (expert={ep}) needs a mixture-of-experts model; "
            f"{cfg.model.family} has no experts: set ici_mesh.expert=1 and dcn_mesh.expert=1"
        )
    if ep > 1 and n_experts % ep:
        raise ConfigError(f"expert-parallel degree {ep} does not divide model.n_experts={n_experts}; "
                          f"choose an expert degree that divides it")
    if tp > 1:
        for what, n in (("model.n_heads", args.n_heads), ("model.n_kv_heads", args.kv_heads),
                        ("the FFN hidden size", args.ffn_hidden_dim), ("seq_len", cfg.seq_len)):
            if n % tp:
                raise ConfigError(
                    f"tensor-parallel degree {tp} does not divide {what}={n}; choose a tensor degree that divides it"
                )
    if cp > 1 and cfg.seq_len % (2 * cp):
        raise ConfigError(
            f"context-parallel degree {cp} needs seq_len divisible by 2 x {cp} = {2 * cp} (load-balanced "
            f"head-tail chunks), got seq_len={cfg.seq_len}"
        )
    if par.pp_schedule not in PP_SCHEDULES:
        raise not_one_of("parallel.pp_schedule", par.pp_schedule, PP_SCHEDULES)
    if pp > 1:
        stages = pp * par.pp_stages_per_rank
        if par.pp_schedule == "interleaved_1f1b" and par.pp_stages_per_rank < 2:
            raise ConfigError("parallel.pp_schedule=interleaved_1f1b needs parallel.pp_stages_per_rank >= 2")
        if par.pp_schedule != "interleaved_1f1b" and par.pp_stages_per_rank != 1:
            raise ConfigError(
                f"parallel.pp_schedule={par.pp_schedule} runs one stage per rank; set parallel.pp_stages_per_rank=1 "
                f"or use interleaved_1f1b"
            )
        if args.n_layers < stages:
            raise ConfigError(
                f"{stages} pipeline stages (pipeline={pp} x pp_stages_per_rank={par.pp_stages_per_rank}) need at "
                f"least as many layers, got model.n_layers={args.n_layers}"
            )
        microbatches = cfg.micro_batch_size if par.pp_microbatches == -1 else par.pp_microbatches
        if microbatches < 1 or cfg.micro_batch_size % microbatches:
            raise ConfigError(
                f"parallel.pp_microbatches={par.pp_microbatches} must divide micro_batch_size={cfg.micro_batch_size}"
            )
        if par.pp_schedule == "1f1b" and microbatches < pp:
            raise ConfigError(
                "1f1b needs at least as many pipeline micro-batches as stages: "
                f"parallel.pp_microbatches={microbatches} < pipeline={pp}; "
                "raise parallel.pp_microbatches (or -1: one per sequence) or use pp_schedule=gpipe"
            )
        if par.pp_schedule == "interleaved_1f1b" and microbatches % pp:
            raise ConfigError(
                f"interleaved_1f1b needs the pipeline micro-batches ({microbatches}) to be a multiple of pipeline={pp}"
            )
        if args.tie_embeddings:
            raise ConfigError(
                f"{cfg.model.family} {cfg.model.flavor} ties its embedding to its output projection, which pipeline "
                f"stages split apart; use pipeline=1 (FSDP/TP scale it fine)"
            )
        if cp > 1:
            raise ConfigError("context and pipeline parallelism together are not supported yet; set one of them to 1")
    if cfg.data.document_mask and (cp > 1 or pp > 1):
        raise ConfigError("data.document_mask does not run with context or pipeline parallelism yet; "
                          "set data.document_mask=false or use data/fsdp/tensor axes")
