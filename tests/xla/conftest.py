"""The XLA path's tests run `ember` in subprocesses with 8 virtual jax CPU devices: importing torchax renames
torch's privateuse1 backend, which would change the torch tests sharing this process (and jax's device count
is fixed when it starts)."""

import json
import subprocess
import sys

import pytest

XLA_ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}


@pytest.fixture
def xla_env() -> dict[str, str]:
    from tests.helpers import job_env

    env = job_env(**XLA_ENV)
    env.pop("OMP_NUM_THREADS", None)  # XLA's CPU devices share the two cores through its own thread pool
    return env



def run_xla_script(script: str, *args: str) -> dict:
    """`python -c script args...` on the 8 virtual devices; the JSON object its last line prints."""
    from tests.helpers import job_env

    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                          env=job_env(**XLA_ENV), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
