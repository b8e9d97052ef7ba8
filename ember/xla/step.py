"""The XLA path's train step: one jit-compiled jax function for forward, backward, gradient accumulation,
clipping and the AdamW update, over weights and optimizer state that live as sharded jax arrays.

torch autograd does not run under jax tracing (`loss.backward()` sees no graph), so the step is functional:
the model's forward is called with the jax arrays as its parameters (torchax's reparametrisation) inside
`jax.value_and_grad`. The loss math is the torch path's (ember/train/step.py): the summed token cross-entropy of each
micro-batch times 1 / (target tokens of the global batch), in fp32; the MoE router losses join the objective,
not the reported loss, weighted as the torch engine's nn/moe_stats.RouterLoss weighs them. What differs, and why:
- the cross-entropy is F.cross_entropy, not nn/loss.py's fused one (its in-place exp_ has no jax lowering);
- AdamW is optax's (torch's foreach/fused kernels have no lowering): scale_by_adam then decoupled weight
  decay on the groups optim.param_groups decays, times -lr: torch's AdamW update, the same arithmetic;
- MoE experts run as `jax.lax.ragged_dot` over the expert-sorted tokens (dropless, static shapes: XLA's
  grouped matmul) instead of grouped_mm or a loop over data-dependent splits;
- remat policies are jax.checkpoint policies (model.remat keys unchanged), and model.scan_layers runs the
  blocks as one jax.lax.scan over stacked weights.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

from ember.constants import IGNORE_INDEX
from ember.nn.attention import Kernel, document_layout, set_attention_kernel
from ember.nn.moe_stats import MoEStats

Params = dict[str, Any]  # name -> jax.Array


@dataclass(frozen=True)
class StepOptions:
    max_grad_norm: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    remat: str  # model.remat: none | full | selective | op | offload
    remat_every: int
    scan_layers: bool
    compute_dtype: torch.dtype  # the forward's parameter dtype (fp32 master weights stay fp32)
    eos_id: Optional[int]  # document masking
    router_coefs: tuple[float, float]  # (aux, z): model.aux_loss_coef, model.z_loss_coef
    router_weight_per_token: float  # 1 / (tokens per step x MoE layers): nn/moe_stats.RouterLoss's weight
    attention_kernel: Optional[Kernel] = None  # xla/attention.attention_kernel; None: the model's own


BLOCK_INPUT = "block_input"  # the checkpoint_name of each block's input hidden state


def remat_policy(policy: str) -> Any:
    """model.remat's jax.checkpoint policy: full/selective save nothing inside a block (its input stays on the
    device for the backward), op saves the matmul outputs (dots), offload saves nothing inside a block and
    moves its input to the host's pinned memory (torchprime's scan-offload and MaxText's offloaded
    decoder_layer_input: no activation per layer stays on the device); None: no remat."""
    import jax

    cp = jax.checkpoint_policies
    if policy in ("full", "selective"):
        return cp.nothing_saveable
    if policy == "op":
        return cp.dots_saveable
    if policy == "offload":
        return cp.save_and_offload_only_these_names(names_which_can_be_saved=[],
                                                    names_which_can_be_offloaded=[BLOCK_INPUT],
                                                    offload_src="device", offload_dst="pinned_host")
    return None


def _named_input(h: torch.Tensor) -> torch.Tensor:
    """h, named BLOCK_INPUT for the remat policy (a copy the policy may offload; the name alone changes nothing)."""
    from jax.ad_checkpoint import checkpoint_name
    from torchax import interop

    return interop.call_jax(checkpoint_name, h, BLOCK_INPUT)


def _xla_experts(experts: nn.Module, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Experts.forward's math over tokens sorted by expert, each weight one ragged_dot over the groups."""
    import jax
    import jax.numpy as jnp
    from torchax import interop

    def grouped(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # x (M, in), w (E, out, in) -> (M, out)
        return interop.call_jax(lambda a, b, n: jax.lax.ragged_dot(a, jnp.swapaxes(b, 1, 2), n.astype(jnp.int32)),
                                x, w.to(x.dtype), counts)

    h = experts.activation(grouped(x_sorted, experts.w1))
    if experts.gated:
        h = h * grouped(x_sorted, experts.w3)
    return grouped(h, experts.w2)


def xla_dispatch(run_experts: Callable[..., torch.Tensor], x_sorted: torch.Tensor, counts: torch.Tensor,
                 experts: nn.Module) -> torch.Tensor:
    """The traced model's MoE dispatch (nn/moe_stats.Dispatch): its experts as ragged_dot, not the layer's own
    grouped or looped path, whose splits depend on the data."""
    return _xla_experts(experts, x_sorted, counts)


class ScannedBlocks(nn.Module):
    """The model's blocks as one module whose forward is a jax.lax.scan over their stacked weights: XLA
    compiles one block whatever the depth. Stands in for Decoder.layers' values (the Decoder calls it as it
    calls a block); `stacked` holds the (n_layers, ...) weights while a traced forward runs, and `moe_stats`
    after it each MoE statistic stacked over the layers, (n_layers, ...)."""

    def __init__(self, block: nn.Module, policy: Any, stats: MoEStats):
        super().__init__()
        self.block, self.policy, self.stats = block, policy, stats
        self.stacked: Optional[dict[str, torch.Tensor]] = None
        self.moe_stats: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def forward(self, h: torch.Tensor, *rest: Any) -> torch.Tensor:
        import jax
        from torchax import interop

        def run(x: torch.Tensor, params: dict[str, torch.Tensor]) -> tuple:
            with _reparametrize_module(self.block, params):
                out = self.block(_named_input(x), *rest)
            # a trace's values, which a jax.checkpoint or scan must return as outputs (left in the collector, they
            # would escape their transformation)
            return out, self.stats.take(self.block)

        step = functools.partial(interop.call_torch, run)
        if self.policy is not None:
            step = jax.checkpoint(step, policy=self.policy)
        out, stats = jax.lax.scan(lambda carry, layer: step(carry, layer), interop.jax_view(h),
                                  interop.jax_view(self.stacked))
        self.moe_stats = interop.torch_view(stats)
        return interop.torch_view(out)


def prepare_model(model: nn.Module, options: StepOptions, hidden: Any, stats: MoEStats,
                  split: Optional[tuple[Any, tuple[str, ...], tuple[str, ...]]] = None,
                  ) -> tuple[nn.Module, Optional[ScannedBlocks]]:
    """`model` (built with xla_dispatch and `stats` as its MoE options, no autograd router loss: the step adds it)
    made ready for tracing, in place: each block's output constrained to `hidden` (a NamedSharding of (B, T,
    dim): sequence parallelism at block boundaries); with `split` (tensor parallelism: a column-wise output's
    sharding, the block's column-wise and row-wise Linears), the column-wise Linears' outputs constrained to whole
    sequences and a tensor rank's features and the row-wise ones' back to `hidden`, as Megatron-LM splits a block
    (left to propagation, the FFN ran on the sequence split with its weights gathered whole over every device, and
    RoPE's output was resharded to heads by all-to-alls); options.attention_kernel in each attention; blocks
    rematerialised by jax.checkpoint; with scan_layers the blocks replaced by one ScannedBlocks (returned) over
    layer 0's module."""
    import jax
    from torchax import interop

    def to(sharding: Any) -> Callable[..., torch.Tensor]:  # a forward hook constraining a module's output
        def hook(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
            return interop.call_jax(jax.lax.with_sharding_constraint, out, sharding)
        return hook

    for block in model.layers.values():
        block.register_forward_hook(to(hidden))
        if split is None:
            continue
        # Megatron's split of a block under tensor parallelism: the column-wise Linears' outputs hold whole
        # sequences and a tensor rank's features, the row-wise ones' go back to the sequence split
        column, colwise, rowwise = split
        for names, sharding in ((colwise, column), (rowwise, hidden)):
            for name in names:
                module = _submodule(block, name)
                if isinstance(module, nn.Linear):
                    module.register_forward_hook(to(sharding))
    if options.attention_kernel is not None:
        set_attention_kernel(model, options.attention_kernel)
    policy = remat_policy(options.remat)
    if options.scan_layers:
        scanned = ScannedBlocks(model.layers["0"], policy, stats)
        model.layers = nn.ModuleDict({"scan": scanned})
        return model, scanned
    if policy is not None:
        for name, block in model.layers.items():
            if options.remat == "selective" and int(name) % options.remat_every:
                continue
            block.forward = _rematerialised(block, policy, stats)
    return model, None


def _submodule(block: nn.Module, name: str) -> Optional[nn.Module]:
    """`block`'s module `name`, or None where this block has none (a dense block's FFN in an MoE block)."""
    try:
        return block.get_submodule(name)
    except AttributeError:
        return None


def _rematerialised(block: nn.Module, policy: Any, stats: MoEStats) -> Callable[..., torch.Tensor]:
    """block.forward under jax.checkpoint. The block's weights go in as arguments, not through the closure:
    jax.checkpoint must see them as inputs to recompute from (closed over, their tracers escape)."""
    import jax
    from torchax import interop

    forward = block.forward

    def run(params: dict[str, torch.Tensor], h: torch.Tensor, *rest: Any) -> tuple:
        with _reparametrize_module(block, params):
            out = forward(_named_input(h), *rest)
        return out, stats.take(block)

    checkpointed = jax.checkpoint(interop.jax_view(run), policy=policy)

    def rematerialised(*args: Any) -> torch.Tensor:
        # the weights of this trace: the step's _reparametrize_module has put them on the block
        out, taken = interop.call_jax(checkpointed, dict(block.named_parameters()), *args)
        stats.put(block, taken)
        return out
    return rematerialised


def adamw(options: StepOptions, decay: dict[str, bool]) -> Any:
    """optax AdamW as torch's: bias-corrected Adam, then weight decay on the parameters `decay` marks; the
    step multiplies the update by -lr (lr comes from the torch LR schedule, one value per step)."""
    import optax

    b1, b2 = options.betas
    return optax.chain(optax.scale_by_adam(b1=b1, b2=b2, eps=options.eps),
                       optax.add_decayed_weights(options.weight_decay, mask=decay))


@dataclass
class CompiledStep:
    """The jitted functions of one run: train(params, opt_state, inputs, labels, lr) -> (params, opt_state,
    loss, grad_norm, moe_counts, router_losses) and evaluate(params, inputs, labels) -> loss; inputs and
    labels (micro-batches, B, T); logits for scoring."""

    train: Callable[..., Any]
    evaluate: Callable[..., Any]
    logits: Callable[..., Any]  # (params, tokens (B, T), index (B, K)) -> (B, K, vocab) fp32: eval.tasks' scoring
    loss_and_grads: Callable[..., Any]  # (params, inputs, labels, scale) -> ((loss, ...), grads): the tests'
    micro_loss: Callable[..., Any]  # the same, unjitted and without gradients: what the tests ask jax about


def build_step(model: nn.Module, scanned: Optional[ScannedBlocks], stats: MoEStats, options: StepOptions, tx: Any,
               buffers: Params, tied: dict[str, str], shardings: dict[str, Any]) -> CompiledStep:
    """The run's compiled functions. `stats`: the collector `model`'s MoE layers report to; `buffers`: the model's
    (replicated) buffers; `tied`: alias -> parameter
    name for weights one module shares with another; `shardings`: {"params", "opt_state", "batch", "hidden",
    "replicated"} NamedShardings (pytrees where they are)."""
    import jax
    import jax.numpy as jnp
    from torchax import interop

    moes = model.moe_layers()
    low = options.compute_dtype != torch.float32
    jax_dtype = jnp.bfloat16 if options.compute_dtype == torch.bfloat16 else jnp.float16
    aux_coef, z_coef = options.router_coefs

    def forward(params: dict[str, torch.Tensor], *inputs: Any, **kwargs: Any) -> Any:
        """The model's forward with `params` (the devices' weights, tied aliases added) as its parameters."""
        state = dict(params)
        state.update({alias: state[name] for alias, name in tied.items()})
        if scanned is not None:
            prefix = "layers.scan.block."
            scanned.stacked = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
            state = {k: v for k, v in state.items() if not k.startswith(prefix)}
        with _reparametrize_module(model, state, strict=False):
            out = model(*inputs, **kwargs)
        if scanned is not None:
            scanned.stacked = None
        return out

    def torch_loss(params: dict[str, torch.Tensor], inputs: torch.Tensor, labels: torch.Tensor) -> tuple:
        positions = document_ids = None
        if options.eos_id is not None:
            document_ids, positions = document_layout(inputs, options.eos_id)
        logits = forward(params, inputs, positions, document_ids)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")
        # each MoE layer's router losses (L,), (L,) and load (L, E): the scan's stacked outputs, or the layers'
        if scanned is not None and scanned.moe_stats:
            aux, z, counts = scanned.moe_stats[0]
        elif moes:
            aux, z, counts = (torch.stack(column) for column in zip(*stats.take(model)))
        else:
            return loss, loss.new_zeros(()), (loss.new_zeros((0,)), loss.new_zeros((0,)))
        router = (aux_coef * aux + z_coef * z).sum() * inputs.numel()
        return loss, router * options.router_weight_per_token, (counts, torch.stack([aux, z], dim=1))

    def micro_loss(params: Params, inputs: Any, labels: Any, scale: Any) -> tuple[Any, Any]:
        if low:  # fp32 master weights, the forward in the compute dtype: their gradients come back fp32
            params = {k: v.astype(jax_dtype) if jnp.issubdtype(v.dtype, jnp.floating) else v for k, v in params.items()}
        inputs = jax.lax.with_sharding_constraint(inputs, shardings["batch"])
        loss, router, (counts, aux) = interop.call_torch(torch_loss, {**params, **buffers}, inputs, labels)
        # the router losses join the gradient at their own weight, not the token mean's (nn/moe.py)
        return loss * scale + router, (loss * scale, counts, aux)

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def accumulate(params: Params, inputs: Any, labels: Any, scale: Any) -> tuple:
        def body(carry: tuple, batch: tuple) -> tuple:
            grads, loss, counts = carry
            (_, (micro, micro_counts, aux)), g = grad_fn(params, batch[0], batch[1], scale)
            grads = jax.tree.map(jnp.add, grads, g)
            return (grads, loss + micro, counts + micro_counts), aux

        first = jax.eval_shape(grad_fn, params, inputs[0], labels[0], scale)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (first[1], first[0][1][0], first[0][1][1]))
        (grads, loss, counts), aux = jax.lax.scan(body, zeros, (inputs, labels))
        return grads, loss, counts, aux[-1]

    def token_scale(labels: Any) -> Any:  # 1 / target tokens of the global batch, as ember/train/step.py weighs
        return 1.0 / jnp.maximum(jnp.sum(labels != IGNORE_INDEX), 1).astype(jnp.float32)

    def train(params: Params, opt_state: Any, inputs: Any, labels: Any, lr: Any) -> tuple:
        grads, loss, counts, aux = accumulate(params, inputs, labels, token_scale(labels))
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads)))
        if options.max_grad_norm > 0:  # torch's clip_grad_norm_: coef max_norm / (norm + 1e-6), at most 1
            coef = jnp.minimum(options.max_grad_norm / (norm + 1e-6), 1.0)
            grads = jax.tree.map(lambda g: g * coef, grads)
        updates, new_opt = tx.update(grads, opt_state, params)
        new_params = jax.tree.map(lambda p, u: p - lr * u, params, updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(norm)  # a non-finite step changes nothing (ember/train/trainer.py)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
        return keep(new_params, params), keep(new_opt, opt_state), loss, norm, counts, aux

    def evaluate(params: Params, inputs: Any, labels: Any) -> Any:
        scale = token_scale(labels)

        def body(total: Any, batch: tuple) -> tuple:
            _, (loss, _, _) = micro_loss(params, batch[0], batch[1], scale)
            return total + loss, None
        return jax.lax.scan(body, jnp.zeros((), jnp.float32), (inputs, labels))[0]

    def torch_logits(params: dict[str, torch.Tensor], tokens: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        logits = forward(params, tokens, logits_at=index)
        if scanned is not None:
            scanned.moe_stats = []
        stats.take(model)  # a scoring forward's router statistics are no step's: dropped inside the trace
        return logits.float()

    def logits(params: Params, tokens: Any, index: Any) -> Any:
        """(B, K, vocab) fp32 logits of `tokens` (B, T) at the positions `index` (B, K): eval.tasks' scoring."""
        if low:
            params = {k: v.astype(jax_dtype) if jnp.issubdtype(v.dtype, jnp.floating) else v for k, v in params.items()}
        return interop.call_torch(torch_logits, {**params, **buffers}, tokens, index)

    p, o, r = shardings["params"], shardings["opt_state"], shardings["replicated"]
    return CompiledStep(
        train=jax.jit(train, out_shardings=(p, o, r, r, r, r), donate_argnums=(0, 1)),
        evaluate=jax.jit(evaluate, out_shardings=r), logits=jax.jit(logits, out_shardings=r),
        loss_and_grads=jax.jit(grad_fn), micro_loss=micro_loss)
