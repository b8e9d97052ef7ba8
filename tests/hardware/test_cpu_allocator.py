"""keep_freed_cpu_memory: on glibc a CPU run's large buffers come from malloc's reusable heap instead of fresh
mmaps, and a user's own choice (EMBER_CPU_MALLOC=default, glibc's environment settings) is left alone."""

import json
import os
import platform
import subprocess
import sys

import pytest

# Each test starts a Python process that imports torch (about 3 s here).
pytestmark = pytest.mark.slow

# Allocates a 64 MiB tensor and reads glibc's mallinfo2: hblkhd is the bytes held in mmapped blocks.
PROBE = """
import ctypes, json, torch
from ember.hardware.cpu_allocator import keep_freed_cpu_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
note = keep_freed_cpu_memory()
before = libc.mallinfo2().hblkhd
buffer = torch.empty(64 << 20, dtype=torch.uint8)
print(json.dumps({"note": note, "mmapped": libc.mallinfo2().hblkhd - before, "again": keep_freed_cpu_memory()}))
"""

needs_glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only (this CI is glibc)")


def _probe(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("EMBER_CPU_MALLOC", "LD_PRELOAD", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_",
                          "GLIBC_TUNABLES")}
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env={**clean, **env},
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_glibc
def test_a_large_buffer_comes_from_the_reusable_heap():
    result = _probe()
    assert result["note"] == "glibc malloc keeps up to 1 GiB freed for reuse" == result["again"]
    assert result["mmapped"] == 0


@needs_glibc
@pytest.mark.parametrize("env", [{"EMBER_CPU_MALLOC": "default"}, {"MALLOC_TRIM_THRESHOLD_": "131072"}])
def test_the_users_choice_is_left_alone(env):
    result = _probe(**env)
    assert result["note"] is None and result["again"] is None
    assert result["mmapped"] >= 64 << 20  # glibc's default: a fresh mmap for a block this large
