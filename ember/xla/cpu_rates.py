"""What jax's CPU backend (XLA:CPU) runs at on this machine, for `ember plan --device cpu` of the XLA path
(device=xla): its matmul peak (the per-role model's rate), the rate of each matmul a compiled step runs, and the
bandwidth of its element-wise fusions (ember.xla.plan prices the compiled step with both). XLA:CPU's dot is its own
code, not the oneDNN kernels torch calls: on a 2-core Xeon with AMX it ran fp32 at about half of torch's rate
(docs/tpu.md), so torch's figures would plan the XLA step twice as fast as it runs. Measured once per machine and
jax release, on one CPU device, and kept in the same cache as torch's rates (ember.hardware.cpu_rates: a figure
measured while other processes were busy is provisional)."""

from __future__ import annotations

import hashlib
import os
import time
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterable

import torch

from ember.hardware import cpu_rates
from ember.xla.program_cost import NUMPY_DTYPES, Dot


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


def l2_cache_bytes() -> int:
    """One core's L2 cache (Linux sysfs), or 1 MiB where the kernel does not say."""
    try:
        size = Path("/sys/devices/system/cpu/cpu0/cache/index2/size").read_text().strip()
        return int(size[:-1]) * {"K": 2**10, "M": 2**20}[size[-1]] if size[-1] in "KM" else int(size)
    except (OSError, ValueError):
        return 2**20


STREAMED_ELEMENTS = 1 << 26  # 768 MB moved by one a * x + y: far past any cache


def _fastest(fn: Callable, args: tuple, seconds: float) -> float:
    """The fastest of `fn(*args)`'s runs within ~`seconds`, at least three, after one that compiles it."""
    fn(*args).block_until_ready()
    fastest, runs, deadline = float("inf"), 0, time.perf_counter() + seconds
    while time.perf_counter() < deadline or runs < 3:
        start = time.perf_counter()
        fn(*args).block_until_ready()
        fastest, runs = min(fastest, time.perf_counter() - start), runs + 1
    return fastest


def measure_xla_bandwidths(seconds: float = 0.5) -> dict[str, float]:
    """Bytes/s of an XLA:CPU element-wise fusion (a * x + y, fp32) on jax's first CPU device, one call a time as a
    step runs its ops: `cached`, moving as many bytes as one core's L2 holds; `streaming`, far past any cache, into
    a new output as a step's large temporaries are written. The best of the calls within ~`seconds` each."""
    import jax
    import jax.numpy as jnp

    device = jax.devices("cpu")[0]
    axpy = jax.jit(lambda x, y: x * 1.0001 + y)
    rates = {}
    for name, n in (("cached", max(l2_cache_bytes() // 12, 1024)), ("streaming", STREAMED_ELEMENTS)):
        x, y = (jax.device_put(jnp.ones((n,), jnp.float32), device) for _ in range(2))
        rates[name] = 12 * n / _fastest(axpy, (x, y), seconds)
    return rates


def xla_cpu_bandwidths() -> cpu_rates.Rates:
    """measure_xla_bandwidths, measured once per machine and jax release and cached (rates: bytes/s)."""
    key = f"{_key(torch.float32).rsplit(' | ', 1)[0]} | element-wise bandwidth, one call"
    return cpu_rates.cached_rates(key, measure_xla_bandwidths, ("cached", "streaming"))


def _dot_signature(dot: Dot) -> str:
    return (f"{dot.describe()} -> {dot.out_dtype} b{list(dot.lhs_batch)}{list(dot.rhs_batch)} "
            f"c{list(dot.lhs_contracting)}{list(dot.rhs_contracting)}")


def measure_dot_flops(dots: list[Dot], devices: int = 1, seconds: float = 0.15) -> dict[str, float]:
    """FLOP/s of each of `dots` (by _dot_signature) run on jax's first `devices` CPU devices at once, one product
    per device as a step's devices each run theirs, all sharing the cores: the best of its runs within ~`seconds`
    (at least three). Several small products at once run faster per FLOP than one alone, which leaves threads
    idle between its tiles."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    budget = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    rates = {}
    for dot in dots:
        # a quarter of the host's memory at most: a product too large to run on every device at once (a MoE
        # layer's experts run densely) is timed on as many as fit, each device's share taken to be the same
        timed = max(1, min(devices, budget // max(dot.nbytes, 1)))
        mesh = Mesh(np.array(jax.devices("cpu")[:timed]), ("device",))
        each = NamedSharding(mesh, PartitionSpec("device"))
        lhs = jax.device_put(jnp.ones((timed, *dot.lhs), NUMPY_DTYPES[dot.lhs_dtype]), each)
        rhs = jax.device_put(jnp.ones((timed, *dot.rhs), NUMPY_DTYPES[dot.rhs_dtype]), each)
        numbers = ((dot.lhs_contracting, dot.rhs_contracting), (dot.lhs_batch, dot.rhs_batch))

        def one(a: jax.Array, b: jax.Array, numbers: tuple = numbers, out: str = dot.out_dtype) -> jax.Array:
            return jax.lax.dot_general(a[0], b[0], numbers, preferred_element_type=jnp.dtype(NUMPY_DTYPES[out]))[None]

        product = jax.jit(jax.shard_map(one, mesh=mesh, in_specs=(PartitionSpec("device"),) * 2,
                                        out_specs=PartitionSpec("device")))
        rates[_dot_signature(dot)] = timed * dot.flops / _fastest(product, (lhs, rhs), seconds)
    return rates


def xla_dot_seconds(dots: Iterable[Dot], devices: int = 1) -> dict[Dot, float]:
    """Seconds each of `dots` takes on XLA:CPU here when `devices` devices run it at once (measure_dot_flops),
    cached under the set of shapes: a small model's matmuls run well under the n x n peak, a large one's above."""
    dots = sorted(set(dots), key=_dot_signature)
    signatures = [_dot_signature(d) for d in dots]
    digest = hashlib.sha1("\n".join(signatures).encode()).hexdigest()[:16]
    key = f"{_key(torch.float32).rsplit(' | ', 1)[0]} | {devices} devices' dots {digest}"
    rates = cpu_rates.cached_rates(key, lambda: measure_dot_flops(dots, devices), tuple(signatures)).rates
    return {dot: devices * dot.flops / rates[sig] for dot, sig in zip(dots, signatures)}
