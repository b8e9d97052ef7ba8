"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"), applied from outside the model.

`apply_lora` turns each target nn.Linear W (out, in) into y = W x + alpha/r * B (A dropout(x)) with
A (r, in) and B (out, r), and freezes every other parameter. The Linear keeps its place and its parameter
names (`layers.0.attention.wq.weight`), so base checkpoints load unchanged; the adapters are its children
(`layers.0.attention.wq.lora_A.weight`, `...lora_B.weight`). Init as peft's: A Kaiming-uniform (a = sqrt 5,
nn.Linear's default), B zero, so an adapted model starts with exactly the base's logits.

Where it runs: in parallelize(), after tensor parallelism and before CP, activation checkpointing, compile
and FSDP. After TP, because torch's ColwiseParallel/RowwiseParallel shard every parameter of the module they
are given (the adapters would be split as if they were W); so here each adapter gets the layout that keeps
B A consistent with the base's split (Megatron-LM's LoRA, NeMo): a column-parallel W (Shard(0) over out)
gets B column-parallel (Shard(0)) and A replicated, so B A x is that rank's slice of the output like W x; a
row-parallel W (Shard(1) over in) gets A row-parallel (Shard(1)) and B replicated, so A x is a partial sum
that B keeps partial, and the module's output reduction (all-reduce or reduce-scatter) sums it with W x.
Before FSDP, because fully_shard must see the adapters to manage them: frozen and trainable parameters then
share one unit per block (FSDP2 allows it; only trainable ones get gradient reduce-scatters).

The base stays frozen: requires_grad False, so no gradient and no optimizer state. With bf16 compute its
matrices are stored in bf16 (`base_dtype`); embeddings and norms stay fp32 so that the residual stream
keeps the precision it has in full training.
"""

from __future__ import annotations

import contextlib
import functools
import math
import zlib
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from ember.config_schema import JobConfig, LoraConfig
from ember.errors import ConfigError
from ember.finetune.base_fingerprint import FINGERPRINT_KEY, run_fingerprint
from ember.finetune.lora_targets import linear, resolve_targets
from ember.models import ModelSpec
from ember.storage.location import canonical

ADAPTER_MARKERS = (".lora_A.", ".lora_B.")


class _FrozenLinearWithAdapter(torch.autograd.Function):
    """out = x W^T (+ bias) + s (x A^T) B^T for a frozen W (and bias), as two GEMMs that write in place.

    By hand because autograd's graph of the same ops makes two passes over activation-sized tensors per
    adapted layer that the math does not need: in forward, B's product is added into a copy of W x (addmm
    is out-of-place); in backward, x's two gradient contributions (through W and through A) are computed
    apart and summed. Here B's product accumulates into W x, and A's contribution into g W, inside the GEMM
    (addmm_). Inputs arrive in the compute dtype (the caller casts; autograd casts the gradients back)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], lora_a: torch.Tensor,
                lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
        down = torch.mm(x, lora_a.t())  # (M, r)
        out = torch.mm(x, weight.t()) if bias is None else torch.addmm(bias, x, weight.t())
        out.addmm_(down, lora_b.t(), alpha=scaling)
        ctx.save_for_backward(x, weight, lora_a, lora_b, down)
        ctx.scaling = scaling
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        x, weight, lora_a, lora_b, down = ctx.saved_tensors
        grad_down = torch.mm(grad, lora_b).mul_(ctx.scaling)  # (M, r)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.mm(grad, weight).addmm_(grad_down, lora_a)
        grad_a = torch.mm(grad_down.t(), x) if ctx.needs_input_grad[3] else None
        grad_b = torch.mm(grad.t(), down).mul_(ctx.scaling) if ctx.needs_input_grad[4] else None
        return grad_x, None, None, grad_a, grad_b, None


class LoraLinear(nn.Linear):
    """An nn.Linear with a low-rank update; made from an existing Linear by `apply_lora` (its class is
    swapped in place, so the instance keeps its parameters, its name and the hooks TP put on it)."""

    lora_A: nn.Linear  # (in -> r): weight (r, in)
    lora_B: nn.Linear  # (r -> out): weight (out, r)
    lora_dropout: nn.Module
    scaling: float  # alpha / r
    lora_enabled: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        autocast = torch.is_autocast_enabled(x.device.type)
        if autocast:
            # One cast of the input for the base's matmul and the adapter's, where autocast casts per matmul.
            x = x.to(torch.get_autocast_dtype(x.device.type))
        if not self.lora_enabled:
            return F.linear(x, self.weight, self.bias)
        dense = type(x) is torch.Tensor and type(self.weight) in (torch.Tensor, nn.Parameter) and x.dim() >= 2
        dropout = self.training and isinstance(self.lora_dropout, nn.Dropout)  # apply_lora adds one only for p > 0
        frozen = not self.weight.requires_grad and (self.bias is None or not self.bias.requires_grad)
        if dense and frozen and not dropout:
            dtype = x.dtype  # the compute dtype: a bf16 base and fp32 adapters meet in it (no-op casts otherwise)
            out = _FrozenLinearWithAdapter.apply(
                x.reshape(-1, x.shape[-1]), self.weight.to(dtype), None if self.bias is None else self.bias.to(dtype),
                self.lora_A.weight.to(dtype), self.lora_B.weight.to(dtype), self.scaling)
            return out.view(*x.shape[:-1], out.shape[-1])
        # DTensors (tensor parallel), dropout on the adapter's input, a trainable base, unbatched input: plain ops
        out = F.linear(x, self.weight, self.bias)
        return out + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


def is_adapter_key(key: str) -> bool:
    return any(marker in key for marker in ADAPTER_MARKERS)


def _adapter_layouts(weight: torch.Tensor) -> Optional[tuple[list[Any], list[Any]]]:
    """(A's placements, B's) for a tensor-parallel base weight (see the module docstring), None if plain."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(weight, DTensor):
        return None
    a_layout, b_layout = [], []
    for placement in weight.placements:
        if isinstance(placement, Shard) and placement.dim == 0:  # column-parallel W: split over out
            a_layout.append(Replicate()), b_layout.append(Shard(0))
        elif isinstance(placement, Shard) and placement.dim == 1:  # row-parallel W: split over in
            a_layout.append(Shard(1)), b_layout.append(Replicate())
        else:
            a_layout.append(Replicate()), b_layout.append(Replicate())
    return a_layout, b_layout


def _make_adapter(in_features: int, out_features: int, like: torch.Tensor, layout: Optional[list[Any]]) -> nn.Linear:
    from torch.distributed.tensor import DTensor, distribute_tensor

    device = like.to_local().device if isinstance(like, DTensor) else like.device
    layer = nn.Linear(in_features, out_features, bias=False, device=device)
    if layout is not None:  # values do not matter yet: init_lora fills them after to_empty
        layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), like.device_mesh, layout,
                                                      src_data_rank=None))
    return layer


def apply_lora(model: nn.Module, rank: int, alpha: float, dropout: float = 0.0, targets: str | Sequence[str] = "all", *,
               train_embeddings: bool = False, train_norms: bool = False, base_dtype: Optional[torch.dtype] = None,
               family: str = "this model") -> list[str]:
    """Freeze `model` (a Decoder or a pipeline stage, plain or tensor-parallel, usually on meta) and add LoRA
    adapters of rank `rank` to the Linear layers `targets` selects (resolve_targets). Returns their names.
    train_embeddings / train_norms leave those trainable; base_dtype casts the frozen matrices (not the
    embedding tables, whose lookups feed the residual stream)."""
    names = resolve_targets(model, targets, rank, family)
    for param in model.parameters():
        param.requires_grad_(False)
    for name in names:
        module = linear(model, name)
        out_features, in_features = module.weight.shape  # global shapes, also for DTensors
        layouts = _adapter_layouts(module.weight)
        module.lora_A = _make_adapter(in_features, rank, module.weight, layouts and layouts[0])
        module.lora_B = _make_adapter(rank, out_features, module.weight, layouts and layouts[1])
        module.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        module.scaling = alpha / rank
        module.lora_enabled = True
        module.__class__ = LoraLinear  # in place: parameter names and TP's hooks stay (see LoraLinear)
    embeddings = [m for m in (getattr(model, "tok_embeddings", None), getattr(model, "pos_embeddings", None))
                  if m is not None]
    trainable: list[nn.Module] = [m for m in model.modules() if isinstance(m, LoraLinear)]
    trainable = [adapter for m in trainable for adapter in (m.lora_A, m.lora_B)]
    if train_embeddings:
        trainable += embeddings + [m for m in (getattr(model, "output", None),) if m is not None]
    if train_norms:
        trainable += [m for m in model.modules() if _is_norm(m)]
    for module in trainable:
        for param in module.parameters(recurse=False):
            param.requires_grad_(True)
    if base_dtype is not None:
        tables = {id(p) for m in embeddings for p in m.parameters()}
        for module in model.modules():
            for pname, param in list(module.named_parameters(recurse=False)):
                if (not param.requires_grad and param.ndim >= 2 and id(param) not in tables
                        and param.dtype != base_dtype):
                    setattr(module, pname, nn.Parameter(param.detach().to(base_dtype), requires_grad=False))
    return names


def _is_norm(module: nn.Module) -> bool:
    from ember.nn.decoder import RMSNorm

    return isinstance(module, (RMSNorm, nn.LayerNorm))


def _seed_for(seed: int, name: str) -> int:
    # One generator per adapter, seeded by the run's seed and the module's name: the same values whatever
    # the layout (a pipeline stage or tensor rank initialises only its own adapters, in any order).
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def init_lora(model_parts: Sequence[nn.Module], seed: int) -> None:
    """A Kaiming-uniform (a = sqrt 5, as peft), B zero, into this rank's shards (plain tensors or DTensors)."""
    for part in model_parts:
        for name, module in part.named_modules():
            if isinstance(module, LoraLinear):
                a = torch.empty(module.lora_A.weight.shape)
                nn.init.kaiming_uniform_(a, a=math.sqrt(5),
                                         generator=torch.Generator().manual_seed(_seed_for(seed, name)))
                _fill(module.lora_A.weight, a)
                _fill(module.lora_B.weight, torch.zeros(module.lora_B.weight.shape))


def _fill(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor into a parameter, keeping only this rank's shard of a DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        local = param.to_local()
        shard = distribute_tensor(full.to(local.device, local.dtype), param.device_mesh, param.placements,
                                  src_data_rank=None)
        local.copy_(shard.to_local())
    else:
        param.copy_(full)


@contextlib.contextmanager
def lora_disabled(model: Union[nn.Module, Sequence[nn.Module]]) -> Iterator[None]:
    """Run `model` as its base: every adapter is skipped inside the block (DPO's reference model is the base
    with adapters off, so no second copy of the model is needed)."""
    parts = model if isinstance(model, (list, tuple)) else [model]
    modules = [m for part in parts for m in part.modules() if isinstance(m, LoraLinear)]
    previous = [m.lora_enabled for m in modules]
    for m in modules:
        m.lora_enabled = False
    try:
        yield
    finally:
        for m, enabled in zip(modules, previous):
            m.lora_enabled = enabled


@torch.no_grad()
def merge_lora(model: nn.Module) -> int:
    """Fold every adapter into its base weight (W + alpha/r B A, computed in fp32) and turn the module back
    into a plain nn.Linear. Plain (unsharded) tensors only. Returns the number of layers merged."""
    merged = 0
    for module in list(model.modules()):
        if isinstance(module, LoraLinear):
            delta = module.lora_B.weight.float() @ module.lora_A.weight.float() * module.scaling  # (out, in)
            module.weight.copy_((module.weight.float() + delta).to(module.weight.dtype))
            for child in ("lora_A", "lora_B", "lora_dropout"):
                delattr(module, child)
            module.__class__ = nn.Linear
            merged += 1
    return merged


def lora_transform(cfg: JobConfig, compute_dtype: torch.dtype) -> Optional[Callable[[nn.Module], list[str]]]:
    """apply_lora with a JobConfig's settings bound (the frozen matrices in bf16 when the compute is), for
    parallelize(lora=...): what the trainer and the planner build alike. None without LoRA."""
    lo = cfg.lora
    if not lo.rank:
        return None
    return functools.partial(apply_lora, rank=lo.rank, alpha=lo.alpha, dropout=lo.dropout, targets=lo.targets,
                             train_embeddings=lo.train_embeddings, train_norms=lo.train_norms,
                             family=cfg.model.family,
                             base_dtype=torch.bfloat16 if compute_dtype == torch.bfloat16 else None)


def run_flops_per_token(cfg: JobConfig, spec: ModelSpec, args: Any, compute_dtype: torch.dtype) -> float:
    """Training FLOPs per token of the run `cfg` describes: the family's 6 N + attention count, for LoRA
    less the frozen weights' gradients plus the adapters' (training_flops_per_token), for DPO plus the frozen
    reference's forward over every row (a third of full training's count)."""
    model_flops = spec.flops_per_token(args, cfg.seq_len)
    flops = model_flops
    transform = lora_transform(cfg, compute_dtype)
    if transform is not None:
        with torch.device("meta"):
            probe = spec.model_cls(args)
        transform(probe)
        flops = training_flops_per_token(model_flops, probe)
    if cfg.task == "dpo":
        flops += model_flops / 3
    return flops


def training_flops_per_token(model_flops: float, model: nn.Module) -> float:
    """Training FLOPs per token of `model` with adapters applied (on meta is enough), from full training's
    `model_flops` (6 N + attention; N without the input embedding lookups): each frozen parameter of N
    skips its weight gradient (2 of its 6 FLOPs), each adapter parameter adds 6. Counting 6 N for a LoRA
    run would report MFU 1.5x too high."""
    output = getattr(model, "output", None)
    lookups = {id(p) for name in ("tok_embeddings", "pos_embeddings") if getattr(model, name, None) is not None
               for p in getattr(model, name).parameters()}
    if output is not None:
        lookups.discard(id(output.weight))  # a tied table is in N, as the output projection
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad and id(p) not in lookups)
    adapters = sum(p.numel() for name, p in model.named_parameters() if is_adapter_key(name))
    return model_flops - 2 * frozen + 6 * adapters


def trainable_names(model_parts: Sequence[nn.Module]) -> set[str]:
    """State-dict names of the trainable parameters (a tied matrix under both of its names)."""
    return {name for part in model_parts for name, p in part.named_parameters(remove_duplicate=False)
            if p.requires_grad}


def trainable_state_dict(model_parts: Sequence[nn.Module]) -> dict[str, Any]:
    """What a LoRA checkpoint holds of the model: the adapters (and embeddings / norms if trained)."""
    names = trainable_names(model_parts)
    state: dict[str, Any] = {}
    for part in model_parts:
        state.update({k: v for k, v in part.state_dict().items() if k in names})
    return state


# ---- config and checkpoint metadata -------------------------------------------------------------------


def check_lora(cfg: LoraConfig, family: str, args: Any, init_from: Optional[str]) -> None:
    """Config-time checks of a LoraConfig section with rank > 0 (targets are resolved on a meta model)."""
    from ember.models import MODELS

    if not (cfg.alpha > 0 and math.isfinite(cfg.alpha)):
        raise ConfigError(f"lora.alpha must be a positive number, got {cfg.alpha}")
    if not 0 <= cfg.dropout < 1:
        raise ConfigError(f"lora.dropout must be in [0, 1), got {cfg.dropout}")
    if not init_from:
        raise ConfigError("lora.rank > 0 adapts a trained base: set model.init_from to it (an HF directory, an "
                          "ember checkpoint or run, or a peft adapter directory)")
    with torch.device("meta"):
        model = MODELS[family].model_cls(args)
    resolve_targets(model, cfg.targets, cfg.rank, family)


def lora_meta(cfg: LoraConfig, init_from: str) -> dict[str, Any]:
    """What a LoRA checkpoint's model.json adds: the adapter settings, the base they sit on and the base's
    fingerprint (its files' sizes and digests), by which loading or resuming the run refuses a changed base."""
    settings = {"rank": cfg.rank, "alpha": float(cfg.alpha), "dropout": float(cfg.dropout),
                "targets": list(cfg.targets) if isinstance(cfg.targets, (list, tuple)) else cfg.targets,
                "train_embeddings": bool(cfg.train_embeddings), "train_norms": bool(cfg.train_norms)}
    base = canonical(init_from)
    return {"lora": settings, "base": base, FINGERPRINT_KEY: run_fingerprint(base)}
