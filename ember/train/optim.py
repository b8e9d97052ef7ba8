"""AdamW with weight-decay groups, LR schedules and gradient clipping, each from its own config section.

`build_optimizer` reads the `optim` section, `lr_multiplier`/`build_lr_scheduler` the `schedule` section
(any object with the OptimConfig / ScheduleConfig attributes will do).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any, Iterable, Optional

import torch
from torch import nn

from ember.config import ConfigError
from ember.config_schema import OptimConfig, ScheduleConfig
from ember.errors import did_you_mean

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

OPTIMIZERS = ("adamw",)
IMPLEMENTATIONS = ("auto", "fused", "foreach", "for-loop")
SCHEDULES = ("cosine", "linear", "wsd", "constant")

# Device types whose fused AdamW kernel `auto` picks: CUDA (ROCm too) since torch 2.0, CPU since 2.4.
# The fused kernel makes one pass per tensor, so it is the fastest on both. On a CPU, foreach is a chain
# of _foreach_* ops, each a full pass over all parameters with its own temporaries, run tensor by tensor
# (CPUs have no multi-tensor kernels), so it loses even to the for-loop, whose per-tensor temporaries
# stay in cache.
FUSED_DEVICE_TYPES = ("cuda", "cpu")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups: decay on matrices; none on embeddings, norms, biases or any other 1-D parameter.

    Decaying gains and biases pulls them towards 0, which is not a prior anyone wants (GPT-3 / Llama
    practice, nanoGPT's configure_optimizers); embeddings are lookups whose rows get sparse, uneven
    gradients, so decay would shrink rare tokens towards 0. Tied weights are listed once: a tied
    output projection shares its embedding's group (no decay).
    """
    embedding_ids = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for param in model.parameters():  # yields each shared parameter once
        if not param.requires_grad:
            continue
        if param.ndim >= 2 and id(param) not in embedding_ids:
            decay.append(param)
        else:
            no_decay.append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def build_optimizer(model: nn.Module, cfg: OptimConfig, device_type: str) -> torch.optim.AdamW:
    """AdamW over `model`'s trainable parameters, from the `optim` config section."""
    if cfg.name not in OPTIMIZERS:
        raise ConfigError(f"unknown optim.name '{cfg.name}'{did_you_mean(cfg.name, OPTIMIZERS)}; "
                          f"choices: {', '.join(OPTIMIZERS)}")
    if cfg.implementation not in IMPLEMENTATIONS:
        hint = did_you_mean(cfg.implementation, IMPLEMENTATIONS)
        raise ConfigError(f"unknown optim.implementation '{cfg.implementation}'{hint}; "
                          f"choices: {', '.join(IMPLEMENTATIONS)}")
    implementation = cfg.implementation
    if implementation == "auto":
        implementation = "fused" if device_type in FUSED_DEVICE_TYPES else "foreach"
    flags = {
        "fused": {"fused": True, "foreach": False},
        "foreach": {"fused": False, "foreach": True},
        "for-loop": {"fused": False, "foreach": False},
    }[implementation]
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **flags
    )


def lr_multiplier(step: int, cfg: ScheduleConfig, max_steps: int) -> float:
    """The factor on the peak lr for 0-based optimizer step `step` (torchtitan's convention).

    With n = step + 1, the number of optimizer steps taken once this one is done, W = warmup_steps:
      warmup (n <= W):  n / (W + 1), from lr/(W+1) up to W/(W+1): no step is wasted at lr 0;
      then the decay progress p = (n - decay_start) / decay_steps, clamped to [0, 1], where
      cosine:   decay_start = W,                  m = r + (1 - r) * (1 + cos(pi p)) / 2
      linear:   decay_start = W,                  m = 1 - (1 - r) * p
      wsd:      decay_start = max_steps - D,      m = 1 - (1 - r) * p  (stable at 1 before it;
                D = round(decay_fraction * max_steps), at most max_steps - W)
      constant: m = 1
    with r = min_lr_ratio. The last step (step = max_steps - 1) runs at exactly r, and steps past
    max_steps (a run extended on resume) stay there. LambdaLR calls this with the number of
    scheduler.step() calls so far, which is the 0-based index of the next optimizer step.
    """
    warmup, floor = cfg.warmup_steps, cfg.min_lr_ratio
    n = step + 1
    if n <= warmup:
        return n / (warmup + 1)
    if cfg.name == "constant":
        return 1.0
    if cfg.name in ("cosine", "linear"):
        decay_steps = max_steps - warmup
    elif cfg.name == "wsd":
        decay_steps = min(round(cfg.decay_fraction * max_steps), max_steps - warmup)
    else:
        raise ConfigError(f"unknown schedule.name '{cfg.name}'{did_you_mean(cfg.name, SCHEDULES)}; "
                          f"choices: {', '.join(SCHEDULES)}")
    decay_start = max_steps - decay_steps
    progress = 1.0 if decay_steps <= 0 else min(max((n - decay_start) / decay_steps, 0.0), 1.0)
    if cfg.name == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0 - (1.0 - floor) * progress


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: ScheduleConfig, max_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over `lr_multiplier`; call .step() once after each optimizer.step()."""
    if cfg.name not in SCHEDULES:  # fail at build time, not at the first step past warmup
        raise ConfigError(f"unknown schedule.name '{cfg.name}'{did_you_mean(cfg.name, SCHEDULES)}; "
                          f"choices: {', '.join(SCHEDULES)}")
    # A partial, not a lambda: LambdaLR.state_dict() saves callable objects' state and skips lambdas.
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(lr_multiplier, cfg=cfg, max_steps=max_steps))


def group_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's settings as this run's config made them (build_optimizer, and the LR schedule's
    initial_lr): all but its parameters and its current lr. A resume applies them over the checkpoint's groups,
    so changed optim.* keys take effect; per-group values (no decay on norms and embeddings) stay per group."""
    return [{k: v for k, v in group.items() if k not in ("params", "param_names", "lr")}
            for group in optimizer.param_groups]


def apply_group_settings(saved_groups: list[dict[str, Any]], settings: list[dict[str, Any]]) -> None:
    """Overwrite a loaded optimizer state's param groups (in place, before it is set on the optimizer) with
    `settings` (group_settings of this run's optimizer, whose groups are built in the same order)."""
    if len(saved_groups) != len(settings):
        raise ConfigError(f"the checkpoint's optimizer has {len(saved_groups)} parameter groups, this run's "
                          f"{len(settings)}; resume with the checkpoint's model and lora settings, or resume=none")
    for saved, now in zip(saved_groups, settings):
        saved.update(now)


def restart_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """After a checkpoint's scheduler state is loaded: the base lrs are this run's (each group's initial_lr,
    optim.lr) and each group's lr is this run's schedule at the resumed step, as LambdaLR computes it; with
    nothing changed, exactly the lr the checkpoint held."""
    groups = scheduler.optimizer.param_groups
    scheduler.base_lrs = [group["initial_lr"] for group in groups]
    lrs = [base * fn(scheduler.last_epoch) for fn, base in zip(scheduler.lr_lambdas, scheduler.base_lrs, strict=True)]
    for group, lr in zip(groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = list(lrs)  # what get_last_lr() reports


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float,
                    pp_mesh: Optional[DeviceMesh] = None) -> torch.Tensor:
    """The total L2 norm of the gradients (a 0-d tensor), after clipping them to max_norm when > 0.

    max_norm <= 0 disables clipping but still measures, so the norm is logged either way. Under FSDP and
    TP the gradients are DTensors: their local squares are summed over the mesh dims they are sharded
    on; gradients on different meshes or layouts are measured apart and combined. Pipeline
    stages hold different parameters, so their squared norms are summed over the pipeline group.
    foreach=True (as torchtitan): a few kernels per device and dtype instead of several per tensor,
    which is what matters on GPUs; on a CPU the two paths cost the same.
    """
    from torch.distributed.tensor import DTensor, Replicate

    params = [p for p in parameters if p.grad is not None]
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements):
            # Tensor parallelism without FSDP leaves sums pending on replicated parameters (norms under
            # sequence parallelism): reduce them here, once, for the norm and the optimizer alike.
            p.grad = p.grad.redistribute(placements=[Replicate() if pl.is_partial() else pl
                                                     for pl in p.grad.placements])
        key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
        groups.setdefault(key, []).append(p)
    squares = []
    for key, group in groups.items():
        if key is None:
            squares.append(torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=2.0, foreach=True) ** 2)
            continue
        # The local shards' squares, summed over each mesh dim the gradients are sharded on (Replicate dims
        # hold copies). By hand rather than DTensor's norm: torch 2.13 reduces several sharded dims at
        # once over a flattened group it builds only for dims in the root mesh's order, and FSDP puts its
        # own dims first (an expert-parallel expert's gradient lives on (tensor, expert) under TP).
        mesh, placements = key
        square = torch.nn.utils.get_total_norm([p.grad.to_local() for p in group], norm_type=2.0, foreach=True) ** 2
        for dim, placement in enumerate(placements):
            if not placement.is_replicate():  # Shard, or FSDP's strided shard of a TP-sharded dim
                torch.distributed.all_reduce(square, group=mesh.get_group(dim))
        squares.append(square)
    device = params[0].grad.device if params else torch.device("cpu")
    total_sq = torch.stack(squares).sum() if squares else torch.zeros((), device=device)
    if pp_mesh is not None:
        torch.distributed.all_reduce(total_sq, op=torch.distributed.ReduceOp.SUM, group=pp_mesh.get_group())
    total = total_sq.sqrt()
    if max_norm > 0:
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total
