"""Host-memory allocator settings for the worker process.

glibc serves allocations above 128 KiB with fresh mmap'd pages and gives them back to the
kernel when freed. A CPU forward pass allocates and frees activations of several MiB per op,
so every op would touch new pages: one page fault per 4 KiB and the kernel zeroing them, which
measured here as half the time of a 2,048-token prefill step. Raising the mmap threshold to
its ceiling (32 MiB) and the trim threshold to 1 GiB keeps freed blocks in the heap for the
next step to reuse (what tcmalloc or jemalloc would do, without preloading them).
"""

from __future__ import annotations

import ctypes
import ctypes.util

import structlog

log = structlog.get_logger(__name__)

# mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling on 64-bit systems
TRIM_THRESHOLD = 1 << 30

_done = False


def keep_freed_memory() -> bool:
    """Apply the settings once per process; False where the C library is not glibc."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not ok:
        log.warning("mallopt_refused", mmap_threshold=MMAP_THRESHOLD, trim_threshold=TRIM_THRESHOLD)
    _done = ok
    return ok
