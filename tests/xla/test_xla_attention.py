"""The TPU flash-attention path (ember/xla/attention.py), run by jax's TPU interpret mode on the CPU: its output
and gradients equal SDPA's math (nn/attention.causal_attention) with grouped-query heads and packed documents.
Interpret mode hangs here on a mesh of several CPU devices, so the kernel runs on a one-device mesh: the
shard_map's partitioning over data and tensor is only exercised on a TPU. Off TPUs, under tensor parallelism, the
pinned SDPA runs per device too: on 8 virtual devices it equals one device's, and a train step attends with each
device's own heads."""

import json
import subprocess
import sys

import pytest

from tests.xla.conftest import XLA_ENV

# Both scripts' inputs: seeded q (B, H, T, D), k and v (B, KV, T, D), and two packed documents per row
INPUTS = """
import torch


def attention_inputs(B, H, KV, T, D, first_document):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g), torch.randn(B, KV, T, D, generator=g),
               torch.randn(B, KV, T, D, generator=g))
    documents = torch.cat([torch.zeros(B, first_document, dtype=torch.long),
                           torch.ones(B, T - first_document, dtype=torch.long)], 1)
    return q, k, v, documents
"""

COMPARE = INPUTS + """
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
q, k, v, documents = attention_inputs(B=2, H=4, KV=2, T=256, D=64, first_document=100)
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


PER_DEVICE = INPUTS + """
import json, re
from ember.xla import runtime
runtime.import_torchax()
import jax, jax.numpy as jnp, torch
from torchax import interop
from types import SimpleNamespace
from ember.nn.attention import AttentionSpan, causal_attention
from ember.parallel.mesh_shape import resolve_mesh
from ember.xla.attention import pinned_layout
from ember.xla.mesh import jax_mesh

axes = ("pipeline", "data", "fsdp", "context", "expert", "tensor")
ici = SimpleNamespace(**{a: {"fsdp": 4, "tensor": 2}.get(a, 1) for a in axes})
mesh = jax_mesh(resolve_mesh(ici, SimpleNamespace(**{a: 1 for a in axes}), 8), jax.devices())
attend = pinned_layout(mesh, causal_attention)
q, k, v, documents = attention_inputs(B=4, H=4, KV=2, T=32, D=8, first_document=12)
out = {}
for docs in (None, documents):
    for span in (None, AttentionSpan(window=8)):
        args = [jnp.asarray(t.numpy()) for t in (q, k, v)] + [None if docs is None else jnp.asarray(docs.numpy())]
        for name, fn in (("pinned", attend), ("sdpa", causal_attention)):
            loss = lambda a, b, c, d: interop.call_torch(lambda x, y, z, w: fn(x, y, z, w, span).square().sum(),
                                                         a, b, c, d)
            value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*args)
            out[f"{name}-{docs is not None}-{span is not None}"] = [float(value)] + [
                jnp.asarray(x).ravel().tolist() for x in grads]

# the scores' per-device shapes in a real train step (scanned blocks, full remat) at fsdp=4 x tensor=2
import dataclasses, numpy as np
from ember.train import run as run_lib
from ember.xla.layout import layout_for
cfg = run_lib.load_config("debug", ["device=xla", "model.n_layers=2", "model.dim=64", "model.n_heads=4",
                                    "model.n_kv_heads=2", "seq_len=32", "global_batch_size=8", "micro_batch_size=2",
                                    "ici_mesh.fsdp=4", "ici_mesh.tensor=2", "model.scan_layers=true",
                                    "model.remat=full"], world_size=8)
spec = run_lib.resolve(cfg, 8, torch.device("cpu"), compute_dtype=torch.float32)
host = run_lib.build_model(dataclasses.replace(spec, device=torch.device("cpu")), None, materialize=False).parts[0]
layout = layout_for(spec, mesh, host, eos_id=None)
params = {n: jax.ShapeDtypeStruct(layout.shapes[n], np.float32, sharding=s) for n, s in layout.param_shardings.items()}
opt = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                   jax.eval_shape(layout.tx.init, params), layout.opt_shardings)
batch = jax.ShapeDtypeStruct((1, 8, 32), np.int32, sharding=layout.batch_sharding)
hlo = layout.compiled.train.lower(params, opt, batch, batch, jax.ShapeDtypeStruct((), np.float32)).compile().as_text()
out["score-shapes"] = sorted(set(re.findall(r"f32\\[(\\d+),32,32\\]\\{[0-9,]*\\} dot\\(", hlo)))
out["dots"] = sorted(set(re.findall(r"f32\\[([0-9,]+)\\]\\{[0-9,]*\\} dot\\(", hlo)))
print(json.dumps(out))
"""


@pytest.mark.slow
def test_under_tensor_parallelism_each_device_runs_its_own_heads_and_features():
    """fsdp=4 x tensor=2: the pinned kernel runs per device, on its rows and its half of the heads (a train step's
    scores are 2 rows x 2 heads per device, not every head of the rows; its FFN splits the features, not the
    sequence), and equals SDPA's math on one device
    with grouped-query heads, packed documents and a sliding window, gradients included."""
    from tests.xla.conftest import run_xla_script

    out = run_xla_script(PER_DEVICE)
    assert out["score-shapes"] == ["4"]  # 2 rows x 2 of the 4 heads; 8 were every head of the rows
    # the FFN split as Megatron splits it: the 64 tokens of the rank's rows x half the 192 hidden features, not
    # half the tokens x all the features (whole weights gathered over every device)
    assert "64,96" in out["dots"] and "32,192" not in out["dots"], out["dots"]
    for docs in ("False", "True"):
        for span in ("False", "True"):
            pinned, sdpa = out[f"pinned-{docs}-{span}"], out[f"sdpa-{docs}-{span}"]
            assert pinned[0] == pytest.approx(sdpa[0], rel=1e-6)
            for got, want in zip(pinned[1:], sdpa[1:]):  # the same math, fp32 sums in another order
                assert got == pytest.approx(want, rel=1e-4, abs=1e-5)
