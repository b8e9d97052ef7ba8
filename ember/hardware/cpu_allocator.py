"""glibc's malloc told to keep a CPU run's freed buffers for reuse (`keep_freed_cpu_memory`)."""

from __future__ import annotations

import os
import platform
from typing import Optional

# glibc's mallopt parameters (malloc.h) and how much freed memory a CPU run keeps for reuse
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
CPU_MALLOC_KEEP_BYTES = 1 << 30
_cpu_allocator_note: Optional[str] = None


def keep_freed_cpu_memory() -> Optional[str]:
    """Tell glibc's malloc to keep freed memory in the process for reuse (mmap and trim thresholds of 1 GiB).
    Returns what was done, for the run's header, or None where nothing was (not glibc, or the user chose).

    Why: every training step allocates and frees the same activation- and logits-sized buffers. By default
    glibc serves blocks above its mmap threshold (128 KiB, adapting up to 32 MiB) with fresh mmaps and hands
    heap tops above its trim threshold back to the OS, so each step page-faults those buffers in again; with
    both thresholds at 1 GiB they are reused. PyTorch's CPU performance guide recommends jemalloc or tcmalloc
    for the same reason; this gets the reuse with nothing to install (benchmarks/finetune_memory.py measures it).
    Left alone where the user chose: EMBER_CPU_MALLOC=default, another allocator preloaded (LD_PRELOAD), or
    glibc's own settings in the environment (MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_THRESHOLD_, GLIBC_TUNABLES).
    Once per process."""
    global _cpu_allocator_note
    if _cpu_allocator_note is not None:
        return _cpu_allocator_note or None
    _cpu_allocator_note = ""
    user_set = [k for k in ("LD_PRELOAD", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")
                if os.environ.get(k)]
    if os.environ.get("EMBER_CPU_MALLOC") == "default" or user_set:
        return None
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        applied = (libc.mallopt(_M_MMAP_THRESHOLD, CPU_MALLOC_KEEP_BYTES) == 1,
                   libc.mallopt(_M_TRIM_THRESHOLD, CPU_MALLOC_KEEP_BYTES) == 1)
    except (OSError, AttributeError):
        return None
    if all(applied):
        _cpu_allocator_note = f"glibc malloc keeps up to {CPU_MALLOC_KEEP_BYTES >> 30} GiB freed for reuse"
    return _cpu_allocator_note or None
