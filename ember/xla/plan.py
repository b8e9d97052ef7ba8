"""`ember plan` for the XLA path: the compiled train step of the run's layout at any world size, per device: its
memory, as XLA's own memory analysis reports it, and its time, priced op by op from the program itself
(ember.xla.program_cost). The step is compiled (never run) over abstract arrays on jax's virtual CPU devices, one
per planned device, in a subprocess started with that many (jax fixes its device count when it starts): the same
shardings and the same program the trainer compiles, laid out by XLA's CPU compiler. A TPU's compiler fuses and
schedules differently, so on a TPU both figures are estimates of what its own compiler would report (docs/tpu.md).

The time: each matmul at the device's rate, each other op's bytes at its memory's bandwidth, the collectives'
bytes at its links'. On a CPU (`--device cpu`) the rates are XLA:CPU's own, measured here: each of the step's
matmuls timed at its shape on every virtual device at once (as the step runs them, sharing the cores), and the
element-wise bandwidth within a core's L2 and past every cache, every device's other ops summed. On an
accelerator they are its datasheet's (the matmul peak at the run's compute dtype times the planner's
COMPUTE_EFFICIENCY, HBM and the link), and nothing overlaps: a bound a TPU's asynchronous collectives and
fusions come in under."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from ember.config import JobConfig, load, save
from ember.errors import ConfigError
from ember.xla.program_cost import ProgramCost, program_cost

# XLA:CPU lowers ragged_dot (the XLA path's experts) to dense products and masks over every expert: its program is
# the CPU's MoE step, not the grouped matmul a TPU runs
MOE_UNPRICED = ("a mixture-of-experts step is not priced for an accelerator from the CPU compiler's program (it runs "
                "each expert matmul densely over every expert); the per-role model's step above stands")


def priced_step(cost: ProgramCost, world: int, target: str, dtype: torch.dtype) -> dict[str, Any]:
    """The step time of a program of per-device `cost` on `world` devices of `target` (a --device name), and its
    parts, in seconds; the per-device FLOPs and bytes they come from."""
    from ember.plan import cost as cost_lib

    if target == "cpu":
        from ember.xla import cpu_rates

        seconds = cpu_rates.xla_dot_seconds(cost.dots, world)  # every device's product at once: the step's time
        bandwidth = cpu_rates.xla_cpu_bandwidths().rates
        fits = cpu_rates.l2_cache_bytes()
        # the other ops one after another on each device, every device's on the same cores
        memory = world * sum(n * size / bandwidth["cached" if size <= fits else "streaming"]
                             for size, n in cost.op_bytes.items())
        collective = world * cost.collective_bytes / bandwidth["streaming"]  # copies between buffers of one host
        matmul = sum(seconds[dot] * n for dot, n in cost.dots.items())
        priced_by = "XLA:CPU's measured matmul rates and element-wise bandwidths on this machine"
    else:
        fab = cost_lib.fabric(target)
        if not fab.memory_gbs:
            raise ConfigError(f"--device {target} lists no memory bandwidth to price the XLA step by")
        # the CPU compiler's dot dtypes are not the device's (jax 0.10's XLA:CPU runs bf16 dots as fp32): every
        # matmul at the run's compute dtype
        matmul = cost.dot_flops / (cost_lib.peak_flops(fab, dtype) * cost_lib.COMPUTE_EFFICIENCY)
        memory = cost.memory_bytes / (fab.memory_gbs * 1e9)
        collective = cost.collective_bytes / (fab.intra_gbs * 1e9 * cost_lib.LINK_EFFICIENCY)
        priced_by = f"{fab.spec.name}'s datasheet rates, nothing overlapped"
    return {"step_s": matmul + memory + collective, "matmul_s": matmul, "memory_s": memory,
            "collective_s": collective, "matmul_flops": cost.dot_flops,
            "memory_bytes": cost.memory_bytes, "collective_bytes": cost.collective_bytes, "priced_by": priced_by}


def compiled_step_here(cfg: JobConfig, world: int, target: str) -> dict[str, Any]:
    """In a process whose jax has >= `world` devices, for `cfg` on `world` devices of `target` (tpu: bf16
    compute, else the precision's): the compiled step's memory per device ("memory": layout.memory_figures) and
    its priced time ("step": priced_step), or why it is not priced ("step_unpriced": a MoE model on an
    accelerator)."""
    from ember.train import run as run_lib
    from ember.xla import mesh as mesh_lib, runtime
    from ember.xla.layout import compile_step, layout_for, memory_figures
    from ember.xla.rules import xla_compute_dtype

    devices = runtime.devices("xla")[:world]
    dtype = xla_compute_dtype(cfg.precision, "tpu" if target.startswith("tpu") else "xla")
    spec = run_lib.resolve(cfg, world, torch.device("cpu"), compute_dtype=dtype)
    host = run_lib.build_model(dataclasses.replace(spec, device=torch.device("cpu")), None, materialize=False).parts[0]
    layout = layout_for(spec, mesh_lib.jax_mesh(spec.shape, devices), host, eos_id=None)
    compiled = compile_step(layout, spec.grad_accum, cfg.micro_batch_size * spec.shape.dp, cfg.seq_len)
    figures: dict[str, Any] = {"memory": memory_figures(compiled)}
    if spec.args.has_experts and target != "cpu":
        figures["step_unpriced"] = MOE_UNPRICED
    else:
        figures["step"] = priced_step(program_cost(compiled.as_text()), world, target, dtype)
    return figures


def compiled_step_on_virtual_devices(cfg: JobConfig, world: int, target: str,
                                     timeout_s: float = 3600) -> dict[str, Any]:
    """compiled_step_here in a subprocess with `world` virtual CPU devices."""
    with tempfile.TemporaryDirectory(prefix="ember-xla-plan-") as folder:
        config = Path(folder) / "config.yaml"
        save(dataclasses.replace(cfg, device="xla"), config)
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "
                   f"--xla_force_host_platform_device_count={world}".strip())
        proc = subprocess.run([sys.executable, "-m", "ember.xla.plan", str(config), str(world), target],
                              capture_output=True, text=True, env=env, timeout=timeout_s)
    if proc.returncode < 0:  # a signal: the kernel's out-of-memory killer sends SIGKILL
        name = signal.Signals(-proc.returncode).name
        hint = " (out of memory?): plan a smaller model or world" if name == "SIGKILL" else ""
        raise ConfigError(f"the XLA path's plan was killed by {name} while compiling and pricing the step at world "
                          f"{world}{hint}")
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or ["no output"]
        said = next((line for line in reversed(lines) if re.match(r"\w+(Error|Exception)\b", line)), lines[-1])
        raise ConfigError(f"the XLA path's plan could not compile the step at world {world}: {said}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":  # python -m ember.xla.plan CONFIG WORLD TARGET
    config_path, world_arg, target_arg = sys.argv[1:4]
    print(json.dumps(compiled_step_here(load(config_path), int(world_arg), target_arg)))
