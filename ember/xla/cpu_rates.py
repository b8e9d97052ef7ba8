"""What jax's CPU backend (XLA:CPU) runs a matmul at on this machine: the peak `ember plan --device cpu` prices the
XLA path's step by (device=xla). XLA:CPU's dot is its own code, not the oneDNN kernels torch calls: on a 2-core
Xeon with AMX it ran fp32 at about half of torch's rate (docs/tpu.md), so torch's figure planned the XLA step twice
as fast as it runs. Measured once per machine and jax release, on one CPU device, and kept in the same cache as
torch's rates (ember.hardware.cpu_rates: a figure measured while other processes were busy is provisional)."""

from __future__ import annotations

import os
import time
from importlib import metadata

import torch

from ember.hardware import cpu_rates


def measure_xla_matmul_flops(dtype: torch.dtype, seconds: float = 0.6,
                             sizes: tuple[int, ...] = cpu_rates.MATMUL_SIZES) -> float:
    """The best FLOP/s of jitted n x n `dtype` products on jax's first CPU device, over `sizes`, ~`seconds` each
    (the best, as ember.hardware.cpu_rates.measure_cpu_matmul_flops: other processes only ever slow a run). A size
    whose one product takes longer than `seconds` (bf16 emulated on a CPU without bf16 instructions) ends the
    search: the larger ones would not be faster per FLOP."""
    import jax
    import jax.numpy as jnp

    device = jax.devices("cpu")[0]
    jax_dtype = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16}[dtype]
    product = jax.jit(jnp.matmul)
    best = 0.0
    for n in sizes:
        keys = jax.random.split(jax.random.PRNGKey(n))
        a, b = (jax.device_put(jax.random.normal(k, (n, n), jax_dtype), device) for k in keys)
        product(a, b).block_until_ready()  # compiles, and warms the thread pool and the output's pages
        deadline = time.perf_counter() + seconds
        while True:
            start = time.perf_counter()
            product(a, b).block_until_ready()
            end = time.perf_counter()
            best = max(best, 2 * n**3 / (end - start))
            if end >= deadline:
                break
        if end - start > seconds:
            break
    return best


def _key(dtype: torch.dtype) -> str:
    # XLA:CPU's thread pool takes every core this process may run on, whatever torch's thread count
    version = metadata.version("jaxlib")
    return (f"{cpu_rates.cpu_model()} | {len(os.sched_getaffinity(0))} cores | xla:cpu jaxlib {version} "
            f"| peak {cpu_rates.dtype_name(dtype)}")


def xla_cpu_peak_flops(dtype: torch.dtype) -> cpu_rates.Rates:
    """This machine's XLA:CPU n x n matmul peak in `dtype` (rates[dtype_name(dtype)]), measured once and cached."""
    name = cpu_rates.dtype_name(dtype)
    return cpu_rates.cached_rates(_key(dtype), lambda: {name: measure_xla_matmul_flops(dtype)}, (name,))
