"""What the XLA path refuses (ember/xla/checks.py), checked from the config before anything starts: each one line
naming the key and the fix. No jax: the world size is given, as `ember launch xpk|tpu-vm` gives it."""

import pytest

from ember.errors import ConfigError
from ember.train import run as run_lib
from ember.xla.checks import refuse_offload_without_host_memory


@pytest.mark.parametrize("overrides, says", [
    (["device=xla", "ici_mesh.pipeline=2", "ici_mesh.fsdp=8"],  # 16 devices: the refusal comes first
     "device=xla has no pipeline parallelism (XLA shards layers with fsdp/tensor instead); set ici_mesh.pipeline=1 "
     "and dcn_mesh.pipeline=1"),
    (["device=xla", "lora.rank=8", "model.init_from=x"], "lora.rank is not supported with device=xla"),
    (["device=tpu", "precision=fp8"],
     "precision=fp8 (fp8.enabled) is not supported with device=tpu; use precision=bf16"),
    (["device=xla", "model.scan_layers=true", "model.remat=selective"],
     "model.scan_layers=true runs every block alike, so model.remat=selective"),
    (["device=xla", "ici_mesh.fsdp=3"], "but the world size is 8; make the axes multiply to jax's 8 device(s)"),
])
def test_what_the_xla_path_refuses_is_one_line_naming_the_key(overrides: list, says: str):
    with pytest.raises(ConfigError) as err:
        run_lib.load_config("debug", ["micro_batch_size=1", *overrides], world_size=8)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_offload_is_refused_where_xla_keeps_activations_on_the_device_and_scan_off_xla():
    cfg = run_lib.load_config("debug", ["device=xla", "model.remat=offload", "ici_mesh.fsdp=8", "micro_batch_size=1"],
                              world_size=8)
    with pytest.raises(ConfigError, match=r"^model.remat=offload needs a TPU's or GPU's pinned host memory, and "
                       r"jax's devices are cpu; use model.remat=full$"):
        refuse_offload_without_host_memory(cfg, "cpu")
    for platform in ("tpu", "gpu"):  # XLA moves the saved activations to the host's pinned memory
        refuse_offload_without_host_memory(cfg, platform)
    refuse_offload_without_host_memory(run_lib.load_config("debug", ["device=xla"], world_size=1), "cpu")
    with pytest.raises(ConfigError, match=r"model.scan_layers=true is the XLA path's"):
        run_lib.load_config("debug", ["device=cpu", "model.scan_layers=true"], world_size=1)
