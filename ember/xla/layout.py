"""A run's XLA layout: the jax Mesh's shardings of every weight, optimizer moment and batch, the optimizer, and
the compiled step, built from the RunSpec and two instances of the model (the host copy, whose names and
shapes the state follows, and the traced one). The trainer builds it over real devices; `ember plan` over
jax's virtual CPU devices with abstract arrays, to read XLA's memory analysis of the same compiled step
(`compiled_memory`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from ember.nn.moe_stats import MoEOptions, MoEStats
from ember.train import run as run_lib
from ember.train.optim import param_groups
from ember.train.run import RunSpec
from ember.xla import mesh as mesh_lib
from ember.xla.attention import attention_kernel
from ember.xla.sharding import param_specs
from ember.xla.step import CompiledStep, StepOptions, adamw, build_step, prepare_model, xla_dispatch

SCAN_PREFIX = "layers.scan.block."


def device_names(model: torch.nn.Module, n_layers: int, scan: bool) -> dict[str, list[str]]:
    """device-state name -> the host parameter names it holds: one each, or with scan_layers the layers'
    names of a block stacked in layer order."""
    names: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        if scan and name.startswith("layers."):
            _, layer, rest = name.split(".", 2)
            names.setdefault(SCAN_PREFIX + rest, [None] * n_layers)[int(layer)] = name
        else:
            names[name] = [name]
    return names


def init_on_devices(model: torch.nn.Module, seed: int, names: dict[str, list[str]],
                    shardings: dict[str, Any]) -> dict[str, Any]:
    """The torch path's seeded init of `model` (a Decoder built on meta) as sharded jax arrays, one piece at a
    time (the embeddings, each block, the norm, the output: Decoder.init_steps, in its order after the same
    torch.manual_seed, so the values are the one-process init's). Each piece is filled on the host, its
    arrays put on the devices, and its host memory freed before the next: a host holds one piece, never the
    model (405B in fp32 would need 1.6 TB). Every host draws the same numbers and sends only its own shards.
    Stacked (scanned) weights go to the devices layer by layer and are stacked there. The model's parameters
    stay the meta ones it was built with."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    slot = {host: (name, i) for name, hosts in names.items() for i, host in enumerate(hosts)}
    qualified = {id(module): prefix for prefix, module in model.named_modules()}
    params: dict[str, Any] = {}
    layers: dict[str, list[Any]] = {name: [None] * len(hosts) for name, hosts in names.items() if len(hosts) > 1}
    torch.manual_seed(seed)
    for modules, fill in model.init_steps():
        kept = [(sub, dict(sub._parameters), dict(sub._buffers)) for module in modules for sub in module.modules()]
        for module in modules:
            module.to_empty(device="cpu")
        with torch.no_grad():
            fill()
        for module in modules:
            prefix = qualified[id(module)]
            for local, param in module.named_parameters():
                name, layer = slot[f"{prefix}.{local}" if prefix else local]
                values = param.detach().numpy()
                if name in layers:  # one layer of a stack: its sharding without the leading layer axis
                    sharding = shardings[name]
                    layers[name][layer] = jax.device_put(values, NamedSharding(sharding.mesh, P(*sharding.spec[1:])))
                else:
                    params[name] = jax.device_put(values, shardings[name])
        for sub, parameters, buffers in kept:  # the meta tensors back: the optimizer's groups and ties refer to them
            sub._parameters.update(parameters)
            sub._buffers.update(buffers)
    for name, stack in layers.items():
        params[name] = jax.jit(lambda xs: jnp.stack(xs), out_shardings=shardings[name])(stack)
        stack.clear()
    return {name: params[name] for name in names}


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """alias -> parameter name, for the names under which one Parameter appears again (tied embeddings)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def _opt_shardings(tx: Any, param_shardings: dict[str, Any], replicated: Any) -> Any:
    """optax's state tree with each moment sharded as its parameter and every scalar replicated."""
    import jax

    shapes = jax.eval_shape(tx.init, {n: jax.ShapeDtypeStruct((1,), np.float32) for n in param_shardings})
    adam = shapes[0]
    rest = jax.tree.map(lambda _: replicated, shapes[1:])
    return (adam._replace(count=replicated, mu=dict(param_shardings), nu=dict(param_shardings)), *rest)


@dataclass
class XlaLayout:
    mesh: Any  # jax.sharding.Mesh
    names: dict[str, list[str]]  # device-state name -> host parameter names (device_names)
    param_shardings: dict[str, Any]
    opt_shardings: Any
    batch_sharding: Any  # (micro-batches, B, T)
    tx: Any  # the optax transform
    compiled: CompiledStep
    shapes: dict[str, tuple[int, ...]]  # device-state name -> its global shape


def layout_for(spec: RunSpec, mesh: Any, host_model: torch.nn.Module, eos_id: Optional[int]) -> XlaLayout:
    """The layout the XLA engine trains with and `ember plan` compiles, in the run's compute dtype."""
    return build_layout(spec, mesh, host_model, spec.compute_dtype, eos_id)


def _tensor_split(spec: RunSpec, mesh: Any) -> Optional[tuple[Any, tuple[str, ...], tuple[str, ...]]]:
    """Under tensor parallelism: the sharding of a column-wise Linear's (B, T, features) output (rows as the batch,
    the sequence over context, the features over tensor) and the block's column-wise and row-wise Linears."""
    if mesh.shape["tensor"] == 1:
        return None
    from jax.sharding import NamedSharding, PartitionSpec as P
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    _, block = spec.model.tp_plan(False)
    batch = mesh_lib.present(mesh, mesh_lib.BATCH_AXES) or None
    column = NamedSharding(mesh, P(batch, mesh_lib.present(mesh, ("context",)) or None, "tensor"))
    return (column, tuple(n for n, style in block.items() if isinstance(style, ColwiseParallel)),
            tuple(n for n, style in block.items() if isinstance(style, RowwiseParallel)))


def build_layout(spec: RunSpec, mesh: Any, host_model: torch.nn.Module, compute_dtype: torch.dtype,
                 eos_id: Optional[int]) -> XlaLayout:
    """`spec`'s layout on `mesh`, compiled over a second instance of the model built here for tracing (on meta:
    only its RoPE tables are real, which go to the devices as constants) and prepared in place
    (ember/xla/step.py: prepare_model). Its MoE layers run their experts as ragged_dot and report their router
    losses, kept differentiable, to the step's own collector, from which the step adds them to its objective
    and returns the loads. The host model may be on the meta device."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    stats = MoEStats(keep_graph=True)
    traced = run_lib.build_model(dataclasses.replace(spec, device=torch.device("cpu")), None, materialize=False,
                                 moe=MoEOptions(dispatch=xla_dispatch, stats=stats)).parts[0]
    traced.init_rope(torch.device("cpu"))
    cfg = spec.cfg
    n_moe = len(host_model.moe_layers())
    options = StepOptions(
        max_grad_norm=cfg.optim.max_grad_norm, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps,
        weight_decay=cfg.optim.weight_decay, remat=cfg.model.remat, remat_every=cfg.model.remat_every,
        scan_layers=cfg.model.scan_layers, compute_dtype=compute_dtype, eos_id=eos_id,
        router_coefs=(cfg.model.aux_loss_coef, cfg.model.z_loss_coef),
        router_weight_per_token=1.0 / (cfg.global_batch_size * cfg.seq_len * max(n_moe, 1)),
        attention_kernel=attention_kernel(mesh.devices.flat[0].platform, mesh))
    names = device_names(host_model, spec.args.n_layers, cfg.model.scan_layers)
    tied = tied_aliases(traced)
    traced, scanned = prepare_model(traced, options, NamedSharding(mesh, mesh_lib.hidden_spec(mesh)), stats,
                                    _tensor_split(spec, mesh))
    specs = param_specs(host_model, spec.model.tp_plan, mesh, [hosts[0] for hosts in names.values()])
    param_shardings = {name: NamedSharding(mesh, P(*((None,) * (len(hosts) > 1)), *specs[hosts[0]]))
                       for name, hosts in names.items()}
    shapes = {name: (*((len(hosts),) if len(hosts) > 1 else ()), *host_model.get_parameter(hosts[0]).shape)
              for name, hosts in names.items()}
    decay = {id(p) for group in param_groups(host_model, cfg.optim.weight_decay) if group["weight_decay"]
             for p in group["params"]}
    tx = adamw(options, {name: id(host_model.get_parameter(hosts[0])) in decay for name, hosts in names.items()})
    replicated = NamedSharding(mesh, P())
    opt_shardings = _opt_shardings(tx, param_shardings, replicated)
    buffers = {name: jax.device_put(np.asarray(_initial_buffer(name, buf, host_model).numpy()), replicated)
               for name, buf in traced.named_buffers()}
    compiled = build_step(traced, scanned, stats, options, tx, buffers, tied,
                          {"params": param_shardings, "opt_state": opt_shardings,
                           "batch": NamedSharding(mesh, mesh_lib.batch_spec(mesh)), "replicated": replicated})
    return XlaLayout(mesh, names, param_shardings, opt_shardings,
                     NamedSharding(mesh, P(None, *mesh_lib.batch_spec(mesh))), tx, compiled, shapes)


def _initial_buffer(name: str, buffer: torch.Tensor, host_model: torch.nn.Module) -> torch.Tensor:
    """A buffer's value for the compiled step: the traced model's own (its RoPE tables), else the host model's where
    it was loaded (model.init_from: DeepSeek-V3's score biases), else zeros, what the family's init_weights gives
    every buffer that init_rope does not fill (the score biases; tests/xla pins it for every family)."""
    if not buffer.is_meta:
        return buffer
    host = host_model.get_buffer(name)
    return host.detach() if not host.is_meta else torch.zeros(buffer.shape, dtype=buffer.dtype)


def compile_step(layout: XlaLayout, micro_batches: int, rows: int, seq_len: int, params: Any = None,
                 opt_state: Any = None) -> Any:
    """The train step compiled (never run) for `micro_batches` x `rows` x `seq_len` batches: a jax `Compiled`.
    `params` and `opt_state`: the run's arrays; default abstract ones of the layout's shapes (nothing is
    allocated)."""
    import jax

    if params is None:
        params = {n: jax.ShapeDtypeStruct(layout.shapes[n], np.float32, sharding=s)
                  for n, s in layout.param_shardings.items()}
        opt_state = jax.tree.map(
            lambda shape, sharding: jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding),
            jax.eval_shape(layout.tx.init, params), layout.opt_shardings)
    batch = jax.ShapeDtypeStruct((micro_batches, rows, seq_len), np.int64 if jax.config.jax_enable_x64 else np.int32,
                                 sharding=layout.batch_sharding)
    lr = jax.ShapeDtypeStruct((), np.float32)
    return layout.compiled.train.lower(params, opt_state, batch, batch, lr).compile()


def memory_figures(compiled: Any) -> dict[str, int]:
    """XLA's memory analysis of a compiled step, per device, in bytes: `arguments` (weights, optimizer state, the
    batch), `temporaries` (activations, gradients, workspace), `outputs` and `aliased` (outputs written over
    donated arguments), and `peak` = arguments + outputs - aliased + temporaries."""
    analysis = compiled.memory_analysis()
    figures = {"arguments": analysis.argument_size_in_bytes, "outputs": analysis.output_size_in_bytes,
               "aliased": analysis.alias_size_in_bytes, "temporaries": analysis.temp_size_in_bytes}
    figures["peak"] = figures["arguments"] + figures["outputs"] - figures["aliased"] + figures["temporaries"]
    return figures


def compiled_memory(layout: XlaLayout, micro_batches: int, rows: int, seq_len: int,
                    params: Any = None, opt_state: Any = None) -> dict[str, int]:
    """memory_figures of the train step compiled (compile_step)."""
    return memory_figures(compile_step(layout, micro_batches, rows, seq_len, params, opt_state))
