"""torchax and jax, imported only for device=tpu|xla, and what the run needs to know of their devices.

torchax 0.0.13 names ~22 named-tensor overloads (`aten.prod.dim_Dimname`, ...) that
torch 2.13 removed, in dicts and lists built at import time; the names are gone from torch's op registry,
so no model can call them. `import_torchax` gives each missing name a placeholder object while torchax
loads (a key that matches no op), and only those: every overload torch still has is torchax's own.
The same import renames torch's privateuse1 backend to "jax" (see the note in import_torchax).
torch_xla is not used: its 2.9 release does not import against torch 2.13 (docs/tpu.md).
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Any

from ember.config_schema import JobConfig
from ember.errors import ConfigError
from ember.xla import checks

EXTRA_HINT = "pip install -e '.[tpu]' torch==2.13.0 (on a TPU VM also: pip install 'jax[tpu]')"


@functools.lru_cache(maxsize=None)
def import_torchax() -> ModuleType:
    """torchax, imported once with its default environment built; a missing extra is one ConfigError."""
    try:
        import jax  # noqa: F401
        import torch
        import torch._ops as ops
    except ImportError:
        raise ConfigError(f"device=tpu|xla needs jax and torchax, which are not installed: {EXTRA_HINT}") from None
    packet = ops.OpOverloadPacket
    original = packet.__getattr__
    missing: list[str] = []

    def overload_or_placeholder(self: Any, key: str) -> Any:
        try:
            return original(self, key)
        except AttributeError:
            if key.startswith("__"):
                raise
            missing.append(f"{self._qualified_op_name}.{key}")
            return object()

    packet.__getattr__ = overload_or_placeholder
    try:
        import torchax
        torchax.default_env()  # its op tables load here, lazily, and name the same overloads
    except ImportError:
        raise ConfigError(f"device=tpu|xla needs torchax, which is not installed: {EXTRA_HINT}") from None
    finally:
        packet.__getattr__ = original
    torchax.missing_overloads = tuple(missing)  # what the shim stood in for (tests read it)
    # torchax registers the "jax" device module (privateuse1) as available but without streams; torch code that
    # probes for an accelerator (DCP's file writer, which the host-side checkpoints use) then asks it for a
    # stream and fails. ember never puts torch tensors on that device (jax arrays go through torchax.interop),
    # so torch's probes are told it is absent.
    torchax.device_module.is_available = lambda: False
    torchax.default_env().override_op_definition(torch.ops.aten.bincount.default, _bincount_of_static_length)
    return torchax


def _bincount_of_static_length(input: Any, weights: Any = None, minlength: int = 0) -> Any:
    """aten.bincount under jit, whose output length must be known when tracing: `minlength` bins. torchax's
    own lowering leaves the length to the values (max + 1), which only eager jax can know. The MoE router,
    its one caller in ember, counts expert indices with minlength = the number of experts, their bound."""
    import jax.numpy as jnp
    from torchax import interop

    length = minlength or None
    return interop.call_jax(lambda x, w: jnp.bincount(x, w, length=length), input, weights)


def start_distributed(device: str) -> None:
    """jax.distributed.initialize() on a multi-host TPU slice or pod (every host runs the same command): jax
    finds the coordinator from the TPU VM's metadata. One host, or device=xla without a coordinator: nothing."""
    import jax

    hosts = [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
    slices = int(os.environ.get("MEGASCALE_NUM_SLICES", "1") or 1)
    coordinator = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if (device == "tpu" and (len(hosts) > 1 or slices > 1)) or coordinator:
        if not jax.distributed.is_initialized():
            jax.distributed.initialize()


def devices(device: str) -> list[Any]:
    """The run's jax devices, all hosts': device=tpu needs TPUs; device=xla takes jax's default backend."""
    import_torchax()
    import jax

    start_distributed(device)
    found = jax.devices()
    platform = found[0].platform
    if device == "tpu" and platform != "tpu":
        raise ConfigError(f"device=tpu but jax's devices are {platform} ({len(found)} of them), not TPUs; on a "
                          "TPU VM install jax[tpu], or use device=xla for jax's default backend")
    return found


def run_devices(cfg: JobConfig) -> list[Any]:
    """`devices(cfg.device)`, refusing what the config asks of them that they cannot do."""
    found = devices(cfg.device)
    checks.refuse_offload_without_host_memory(cfg, found[0].platform)
    return found


def device_count(device: str) -> int:
    """The world size of a device=tpu|xla run: every jax device of every host."""
    return len(devices(device))


def device_kind(device: str) -> str:
    """jax's name for the device ("TPU v6 lite", "cpu", ...): the MFU peak's key."""
    return devices(device)[0].device_kind
