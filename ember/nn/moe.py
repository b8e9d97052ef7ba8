"""Mixture-of-experts pieces shared by the MoE families (Mixtral, GLaM, Qwen3-MoE, DeepSeek, Llama 4): experts,
and the layer (the router is nn/router.py; what a run gives the layer and the statistics collector, nn/moe_stats.py).

Dropless top-k routing: every token goes to its k experts, whatever their load (no capacity factor,
no dropped tokens). Tokens are sorted by expert so each expert multiplies one contiguous block:
- grouped: one `grouped_mm` over all experts' blocks (CUDA's grouped GEMM kernel; on CPU torch's own,
  one GEMM per expert inside the op);
- looped: one matmul per expert from Python, which runs on every device and under torch.compile in fp32.
Expert parallelism (ember/parallel/ep.py) sends each block to the rank that holds its expert.
A forward of few tokens outside training (decoding) skips the sort: each token multiplies its k experts'
weights, gathered (`Experts.gathered`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ember.nn.moe_stats import Dispatch, MoEOptions
from ember.nn.router import Router


class Experts(nn.Module):
    """E experts as 3-D weights, w1 (E, hidden, dim) and w2 (E, dim, hidden): w2[e](act(w1[e] x)), or with
    gated=True (SwiGLU for act=silu: Mixtral) also w3 (E, hidden, dim): w2[e](act(w1[e] x) * w3[e] x).
    GLaM's experts are the ungated two-matrix ReLU form.

    Two paths with the same result (tests/nn/test_moe.py checks outputs and gradients):
    - grouped: one `F.grouped_mm` per weight over every expert's block: CUDA's grouped GEMM kernel, or
      on CPU torch's own kernel (one GEMM per expert inside the op: no Python loop, no padding, the
      loop's numbers bit for bit). Its backward wants a dense output gradient (MoE's routing weights
      give one; a bare `.sum()` gives an expanded one that it rejects).
    - looped: one matmul per expert from Python; runs everywhere, including under torch.compile in fp32.
    MoE passes `grouped=_grouped_available(tokens)`; `impl` = "grouped" or "looped" forces a path
    (benchmarks/moe_throughput.py times both, tests compare them).
    """

    def __init__(self, n_experts: int, dim: int, hidden_dim: int,
                 activation: Callable[[torch.Tensor], torch.Tensor] = F.silu, gated: bool = True):
        super().__init__()
        self.activation, self.gated = activation, gated
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim)) if gated else None
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.impl: Optional[str] = None  # None: the caller's choice; "grouped" | "looped": forced (force_impl)

    def force_impl(self, impl: Optional[str]) -> None:
        """Force the grouped or the looped path (`ember plan` tracks the one a device runs), or None for the
        caller's choice."""
        if impl not in (None, "grouped", "looped"):
            raise ValueError(f"Experts.impl must be None, 'grouped' or 'looped', not {impl!r}")
        self.impl = impl

    def forward(self, x_sorted: torch.Tensor, counts: torch.Tensor, grouped: bool) -> torch.Tensor:
        """x_sorted (M, dim), grouped by expert in order, counts (E,) tokens per expert -> (M, dim)."""
        w1, w2 = _local(self.w1), _local(self.w2)  # this rank's experts under expert parallelism
        w3 = _local(self.w3) if self.gated else None
        dtype = _compute_dtype(x_sorted)
        if self.impl is not None:
            grouped = self.impl == "grouped"
        elif w1.shape[1] * dtype.itemsize % 16:  # grouped_mm wants rows of 16-byte multiples, hidden ones too
            grouped = False
        if grouped:
            # grouped_mm is on no autocast list: cast to the dtype autocast gives the looped matmuls (bf16
            # on CUDA, where the MoE input is the fp32 residual stream), or the fused kernel never runs.
            x_sorted, w1, w2 = (t.to(dtype) for t in (x_sorted, w1, w2))
            offsets = torch.cumsum(counts, 0).to(torch.int32)
            if not self.gated:
                h = self.activation(F.grouped_mm(x_sorted, w1.transpose(-2, -1), offs=offsets))  # (M, hidden)
                return F.grouped_mm(h, w2.transpose(-2, -1), offs=offsets)  # (M, dim)
            # gate and up in one grouped GEMM over (E, 2 x hidden, dim): one kernel launch and one backward instead
            # of two, for a copy of the two weights (what transformers' fused gate_up_proj saves)
            w13 = torch.cat([w1, w3.to(dtype)], dim=1)
            gate, up = F.grouped_mm(x_sorted, w13.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)  # (M, hidden) each
            return F.grouped_mm(self.activation(gate) * up, w2.transpose(-2, -1), offs=offsets)  # (M, dim)
        # unbind, not w[e]: the backward of each w[e] writes a zero-filled (E, ...) gradient (E^2 memory
        # traffic, a third of a debug Mixtral step); unbind's backward stacks the E slices once.
        outputs = []
        blocks = torch.split(x_sorted, counts.tolist())
        w3_slices = w3.unbind(0) if self.gated else [None] * len(blocks)
        for block, w1_e, w2_e, w3_e in zip(blocks, w1.unbind(0), w2.unbind(0), w3_slices):
            if block.shape[0] == 0:
                continue
            h = self.activation(block @ w1_e.t())  # (n_e, hidden)
            if w3_e is not None:
                h = h * (block @ w3_e.t())
            outputs.append(h @ w2_e.t())  # (n_e, dim)
        return torch.cat(outputs) if outputs else x_sorted.new_zeros(x_sorted.shape)

    def gathered(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                 scale_input: bool) -> torch.Tensor:
        """x (N, dim) through each token's k experts `indices` (N, k), weighted by `weights` (N, k) on the output
        (or the input, scale_input) and summed -> (N, dim). Reads each chosen expert's weights once per token:
        for a few tokens (decoding) that is all the work, with static shapes and no host sync (gpt-fast's form)."""
        w1, w2 = _local(self.w1)[indices], _local(self.w2)[indices]  # (N, k, hidden, dim), (N, k, dim, hidden)
        weights = weights[..., None].to(x.dtype)  # (N, k, 1)
        xk = x[:, None] * weights if scale_input else x[:, None].expand(-1, indices.shape[1], -1)  # (N, k, dim)
        h = self.activation(torch.einsum("nkd,nkhd->nkh", xk, w1))
        if self.gated:
            h = h * torch.einsum("nkd,nkhd->nkh", xk, _local(self.w3)[indices])
        out = torch.einsum("nkh,nkdh->nkd", h, w2)
        return (out if scale_input else out * weights).sum(dim=1).to(x.dtype)

    def init_weights(self, out_std: float) -> None:
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        if self.gated:
            nn.init.trunc_normal_(self.w3, mean=0.0, std=out_std)
        nn.init.trunc_normal_(self.w2, mean=0.0, std=out_std)


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts: under expert parallelism the weights are DTensors sharded over the expert
    dimension (ember/parallel/ep.py) and each rank computes with its local (E / ep, ...) block."""
    return weight.to_local() if hasattr(weight, "to_local") else weight


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype matmuls on x run in: autocast's where it is on for x's device, else x's own."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _grouped_available(x: torch.Tensor) -> bool:
    """Whether the experts take the grouped path for these tokens (N, dim):
    - CUDA, bf16 compute (bf16 tokens, or fp32 ones under bf16 autocast): the grouped GEMM kernel;
    - CPU, fp32 or bf16 compute: torch's CPU grouped_mm (one GEMM per expert inside the op), level with
      the loop at few experts and ahead at many (the loop's Python and autograd cost grows with E), so
      CPU tests run the op GPUs run (benchmarks/moe_throughput.py times both paths). Padding every block
      to the largest for one torch.bmm would compute E x the largest block, so it is not used;
    - under torch.compile only with bf16 compute: the op's meta function rejects fp32 ("Expected inputs
      of BF16 type", torch 2.13), while the loop compiles;
    - rows of 16-byte multiples (the kernel's stride check; Experts checks its hidden size too).
    """
    dtype = _compute_dtype(x)
    if not hasattr(F, "grouped_mm"):
        return False
    if x.is_cuda:
        return dtype == torch.bfloat16
    if x.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if torch.compiler.is_compiling() and dtype != torch.bfloat16:
        return False
    return x.shape[-1] * dtype.itemsize % 16 == 0


class MoE(nn.Module):
    """A top-k MoE feed-forward layer: the routed experts' outputs, each weighted by its routing weight (with
    scale_input, Llama 4's form, the weight scales the expert's input instead), plus where the family has one a
    `shared_expert` every token passes through (DeepSeek, Llama 4). `router` is the family's Router (default: softmax
    top-k with norm_topk_prob). Each forward computes the load-balancing loss (Switch Transformer / Mixtral:
    E * sum_e f_e * P_e, f_e the share of routed slots that went to expert e, P_e its mean router probability; 1.0
    when perfectly balanced), the router z-loss (ST-MoE: mean squared log-sum-exp of the logits) and the load
    (tokens per expert), and hands them to `options.stats`, the collector the training engine owns
    (nn/moe_stats.py); the layer keeps none of them. With `options.router_loss` active, a training forward
    attaches its router losses to its output, so they join the gradient wherever backward reaches this layer.
    `options.dispatch` reaches experts held elsewhere (expert parallelism) or runs them another way (XLA)."""

    def __init__(self, dim: int, hidden_dim: int, n_experts: int, top_k: int,
                 activation: Callable[[torch.Tensor], torch.Tensor] = F.silu, gated: bool = True,
                 norm_topk_prob: bool = True, *, router: Optional[Router] = None,
                 shared_expert: Optional[nn.Module] = None, scale_input: bool = False,
                 options: MoEOptions = MoEOptions()):
        super().__init__()
        self.n_experts, self.top_k, self.scale_input = n_experts, top_k, scale_input
        self.router = router if router is not None else Router(dim, n_experts, top_k, norm_topk_prob)
        self.experts = Experts(n_experts, dim, hidden_dim, activation, gated)
        self.shared_expert = shared_expert
        self.options = options

    @contextlib.contextmanager
    def dispatching(self, dispatch: Dispatch) -> Iterator[None]:
        """Route through `dispatch` for the duration, the one change to the options after construction: the
        planner's tracked step stands expert parallelism's all-to-all in by copies of the same size
        (ember/plan/memory.py)."""
        saved, self.options = self.options, dataclasses.replace(self.options, dispatch=dispatch)
        try:
            yield
        finally:
            self.options = saved

    @property
    def dispatch(self) -> Optional[Dispatch]:
        return self.options.dispatch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        flat = x.reshape(-1, D)  # (N, dim)
        weights, indices, logits, scores = self.router.route(flat)  # (N, k), (N, k), (N, E), (N, E)
        slots = indices.flatten()  # (N*k,): slot j is token j // k's (j % k)-th expert
        # (E,) tokens per expert; bincount's output size would depend on the data, which torch.compile cannot trace
        counts = torch.zeros(self.n_experts, dtype=torch.long, device=slots.device).scatter_add_(
            0, slots, torch.ones_like(slots))
        if not self.training and self.dispatch is None and slots.numel() <= self.n_experts:
            out = self.experts.gathered(flat, indices, weights, self.scale_input)  # a few tokens: decoding
        else:
            out = self._sorted(flat, weights, slots, counts)
        if self.shared_expert is not None:
            out = out + self.shared_expert(flat)
        probs = self.router.balance_probabilities(scores)
        share = counts.float() / slots.numel()  # f_e
        aux_loss = self.n_experts * torch.sum(share.detach() * probs.mean(dim=0))
        z_loss = torch.logsumexp(logits.float(), dim=-1).pow(2).mean()
        out = out.reshape(B, T, D)
        # Activation checkpointing recomputes this forward inside backward (a graph task is running then):
        # that is neither new load nor a second router loss.
        training = self.training and torch._C._current_graph_task_id() == -1
        if self.options.stats is not None:
            self.options.stats.observe(self, aux_loss, z_loss, counts, training)
        loss = self.options.router_loss
        if not training or not loss.active:
            return out
        router_loss = loss.aux_coef * aux_loss + loss.z_coef * z_loss
        return attach_router_loss(out, router_loss, flat.shape[0] * loss.weight_per_token)

    def _sorted(self, flat: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor,
                counts: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum (N, dim) with the slots sorted by expert: one block per expert, run
        grouped or looped here, or on the experts' own ranks (`dispatch`)."""
        order = torch.argsort(slots, stable=True)
        token_of_slot = order // self.top_k
        grouped = _grouped_available(flat)
        run_experts = lambda tokens, tokens_per_expert: self.experts(tokens, tokens_per_expert, grouped)  # noqa: E731
        slot_weights = weights.flatten()[order, None]  # (N*k, 1)
        # index_select, not flat[token_of_slot]: the indexing's backward (index_put_ accumulating repeated indices)
        # sums in a thread-dependent order on CPU, so two identical steps differed in the last bit; index_add_ does not
        routed = flat.index_select(0, token_of_slot)  # (N*k, dim)
        tokens = routed * slot_weights if self.scale_input else routed
        if self.dispatch is None:
            out_sorted = run_experts(tokens, counts)  # (N*k, dim)
        else:
            out_sorted = self.dispatch(run_experts, tokens, counts, self.experts)
        if not self.scale_input:
            out_sorted = out_sorted * slot_weights
        # Summed in the stream's dtype: under autocast the experts return bf16, which the routing weights promote
        # back unless they scaled the input (Llama 4) instead.
        return torch.zeros_like(flat).index_add_(0, token_of_slot, out_sorted.to(flat.dtype))  # each token's k experts

    def init_weights(self, out_std: float) -> None:
        nn.init.trunc_normal_(self.router.gate.weight, mean=0.0, std=0.02)
        if self.router.score_bias is not None:
            self.router.score_bias.zero_()
        self.experts.init_weights(out_std)
        if self.shared_expert is not None:
            self.shared_expert.init_weights(out_std)


def has_score_bias(model_parts: list[nn.Module]) -> bool:
    """Whether any router of these model parts balances by a score bias (DeepSeek-V3)."""
    return any(isinstance(m, MoE) and m.router.score_bias is not None for part in model_parts for m in part.modules())


class _RouterLossGradient(torch.autograd.Function):
    """Identity on a MoE layer's output whose backward also starts the router loss's own backward with
    d(objective)/d(router loss) = `weight`."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, router_loss: torch.Tensor, weight: float) -> torch.Tensor:
        # Only the loss's metadata is kept: a saved tensor would have to be recomputed identically under
        # activation checkpointing, which the trainer does not attach again.
        ctx.weight, ctx.like = weight, (router_loss.shape, router_loss.dtype, router_loss.device)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        shape, dtype, device = ctx.like
        return grad_output, torch.full(shape, ctx.weight, dtype=dtype, device=device), None


def attach_router_loss(output: torch.Tensor, router_loss: torch.Tensor, weight: float) -> torch.Tensor:
    """`output`, unchanged, carrying `weight * router_loss` into whatever backward reaches it: the router
    losses join the gradient in the layer that computed them, so nothing has to carry them to the
    loss (a pipeline's last stage holds no earlier stage's MoE layers). Megatron-LM's
    MoEAuxLossAutoScaler does the same."""
    return _RouterLossGradient.apply(output, router_loss, weight)
