"""`ember plan` for the XLA path: the per-device memory of the compiled train step, as XLA's own memory analysis
reports it, for the run's layout at any world size. The step is compiled (never run) over abstract arrays on
jax's virtual CPU devices, one per planned device, in a subprocess started with that many (jax fixes its
device count when it starts): the same shardings and the same program the trainer compiles, laid out by
XLA's CPU compiler. A TPU's compiler fuses and schedules differently, so on a TPU the figure is an estimate
of what XLA's TPU compiler reports (docs/tpu.md)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ember.config import JobConfig, load, save
from ember.errors import ConfigError


def compiled_memory_here(cfg: JobConfig, world: int, target: str) -> dict[str, int]:
    """In a process whose jax has >= `world` devices: the compiled step's memory per device (layout.compiled_memory)
    for `cfg` on `world` devices of `target` (tpu: bf16 compute, else the precision's)."""
    from ember.train import run as run_lib
    from ember.xla import mesh as mesh_lib, runtime
    from ember.xla.layout import compiled_memory, layout_for
    from ember.xla.rules import xla_compute_dtype

    devices = runtime.devices("xla")[:world]
    dtype = xla_compute_dtype(cfg.precision, "tpu" if target.startswith("tpu") else "xla")
    spec = run_lib.resolve(cfg, world, torch.device("cpu"), compute_dtype=dtype)
    host = run_lib.build_model(dataclasses.replace(spec, device=torch.device("cpu")), None, materialize=False).parts[0]
    layout = layout_for(spec, mesh_lib.jax_mesh(spec.shape, devices), host, eos_id=None)
    return compiled_memory(layout, spec.grad_accum, cfg.micro_batch_size * spec.shape.dp, cfg.seq_len)


def compiled_memory_on_virtual_devices(cfg: JobConfig, world: int, target: str,
                                       timeout_s: float = 3600) -> dict[str, int]:
    """compiled_memory_here in a subprocess with `world` virtual CPU devices."""
    with tempfile.TemporaryDirectory(prefix="ember-xla-plan-") as folder:
        config = Path(folder) / "config.yaml"
        save(dataclasses.replace(cfg, device="xla"), config)
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "
                   f"--xla_force_host_platform_device_count={world}".strip())
        proc = subprocess.run([sys.executable, "-m", "ember.xla.plan", str(config), str(world), target],
                              capture_output=True, text=True, env=env, timeout=timeout_s)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError(f"the XLA path's plan could not compile the step at world {world}: {last}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":  # python -m ember.xla.plan CONFIG WORLD TARGET
    config_path, world_arg, target_arg = sys.argv[1:4]
    print(json.dumps(compiled_memory_here(load(config_path), int(world_arg), target_arg)))
