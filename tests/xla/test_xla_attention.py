"""The TPU flash-attention path (ember/xla/attention.py), run by jax's TPU interpret mode on the CPU: its output
and gradients equal SDPA's math (nn/attention.causal_attention) with grouped-query heads and packed documents.
Interpret mode hangs here on a mesh of several CPU devices, so the kernel runs on a one-device mesh: the
shard_map's partitioning over data and tensor is only exercised on a TPU."""

import json
import subprocess
import sys

import pytest

from tests.xla.conftest import XLA_ENV

COMPARE = """
import json
from ember.xla import runtime
runtime.import_torchax()
import jax, jax.numpy as jnp, torch
from jax.experimental.pallas import tpu as pltpu
from torchax import interop
from types import SimpleNamespace
from ember.nn.attention import causal_attention
from ember.parallel.mesh_shape import resolve_mesh
from ember.xla.attention import flash_attention
from ember.xla.mesh import jax_mesh

one = SimpleNamespace(**{a: 1 for a in ("pipeline", "data", "fsdp", "context", "expert", "tensor")})
attend = flash_attention(jax_mesh(resolve_mesh(one, one, 1), jax.devices()[:1]))
g = torch.Generator().manual_seed(0)
B, H, KV, T, D = 2, 4, 2, 256, 64
q, k, v = (torch.randn(B, H, T, D, generator=g), torch.randn(B, KV, T, D, generator=g),
           torch.randn(B, KV, T, D, generator=g))
documents = torch.cat([torch.zeros(B, 100, dtype=torch.long), torch.ones(B, 156, dtype=torch.long)], 1)
out = {}
for name, fn in (("flash", attend), ("sdpa", causal_attention)):
    for docs in (None, documents):
        loss = lambda a, b, c, d: interop.call_torch(lambda x, y, z, w: fn(x, y, z, w).square().sum(), a, b, c, d)
        args = [jnp.asarray(t.numpy()) for t in (q, k, v)] + [None if docs is None else jnp.asarray(docs.numpy())]
        with pltpu.force_tpu_interpret_mode():
            value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*args)
        out[f"{name}-{docs is not None}"] = [float(value)] + [jnp.asarray(x).ravel()[::97].tolist() for x in grads]
short = attend(q[:, :, :32], k[:, :, :32], v[:, :, :32])  # 32 tokens: no 128-token block, SDPA's math
out["short"] = float((short - causal_attention(q[:, :, :32], k[:, :, :32], v[:, :, :32])).abs().max())
print(json.dumps(out))
"""


@pytest.mark.slow
def test_the_tpu_kernel_equals_sdpa_with_gqa_and_documents():
    env = dict(__import__("os").environ, JAX_PLATFORMS=XLA_ENV["JAX_PLATFORMS"])
    proc = subprocess.run([sys.executable, "-c", COMPARE], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for documents in ("False", "True"):
        flash, sdpa = out[f"flash-{documents}"], out[f"sdpa-{documents}"]
        assert flash[0] == pytest.approx(sdpa[0], rel=1e-5)
        for got, want in zip(flash[1:], sdpa[1:]):
            assert got == pytest.approx(want, rel=1e-3, abs=1e-4)
    assert out["flash-True"][0] != pytest.approx(out["flash-False"][0], rel=1e-3)  # the documents mask something
    assert out["short"] == 0.0


def test_the_kernel_is_used_on_tpus_without_a_context_split():
    from types import SimpleNamespace

    from ember.xla.attention import uses_flash

    mesh = lambda context: SimpleNamespace(shape={"context": context})  # noqa: E731
    assert uses_flash("tpu", mesh(1)) and not uses_flash("tpu", mesh(2)) and not uses_flash("cpu", mesh(1))
