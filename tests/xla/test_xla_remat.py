"""model.remat on the XLA path, read from what jax saves for the backward (jax.ad_checkpoint.print_saved_residuals
of the step's loss, debug model, 4 layers, 8 virtual devices): full keeps each block's input on the device;
offload keeps it in the host's pinned memory instead (torchprime's scan-offload), scanned or not. jax's CPU
compiler then keeps it where it is, so only the placement jax asks for is checked here; an H200's device peak is in
docs/tpu.md."""

import pytest

from tests.xla.conftest import run_xla_script

SCRIPT = r"""
import contextlib, io, json
import torch
from ember.xla.runtime import import_torchax
import_torchax()
import jax, jax.numpy as jnp
from jax.ad_checkpoint import print_saved_residuals
from ember.train import run as run_lib
from ember.xla import mesh as mesh_lib
from ember.xla.layout import build_layout

out = {}
for scan in ("true", "false"):
    for remat in ("full", "offload"):
        cfg = run_lib.load_config("debug", ["device=xla", f"model.remat={remat}", f"model.scan_layers={scan}",
                                            "ici_mesh.fsdp=8", "micro_batch_size=1", "seq_len=64"], world_size=8)
        spec = run_lib.resolve(cfg, 8, torch.device("cpu"), compute_dtype=torch.float32)
        host = run_lib.build_model(spec, None, materialize=False).parts[0]
        layout = build_layout(spec, mesh_lib.jax_mesh(spec.shape, jax.devices()), host, torch.float32, None)
        params = {n: jax.ShapeDtypeStruct(s, jnp.float32, sharding=layout.param_shardings[n])
                  for n, s in layout.shapes.items()}
        tokens = jax.ShapeDtypeStruct((8, 64), jnp.int32)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            print_saved_residuals(layout.compiled.micro_loss, params, tokens, tokens, jnp.float32(1.0))
        out[f"scan={scan} {remat}"] = [line.split(" ")[0] for line in printed.getvalue().splitlines()]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def residuals() -> dict:
    return run_xla_script(SCRIPT)


@pytest.mark.slow
def test_scanned_blocks_inputs_go_to_the_host_with_offload(residuals: dict):
    # the scan's stacked block inputs: (4 layers, 8 rows, 64 tokens, width 256)
    assert "f32[4,8,64,256]" in residuals["scan=true full"]
    assert not any("<host>" in r for r in residuals["scan=true full"])
    assert "f32<host>[4,8,64,256]" in residuals["scan=true offload"]
    assert "f32[4,8,64,256]" not in residuals["scan=true offload"]


@pytest.mark.slow
def test_each_blocks_input_goes_to_the_host_with_offload(residuals: dict):
    full, offload = residuals["scan=false full"], residuals["scan=false offload"]
    assert not any("<host>" in r for r in full)
    assert offload.count("f32<host>[8,64,256]") == 4  # one per block
    assert offload.count("f32[8,64,256]") == full.count("f32[8,64,256]") - 4
