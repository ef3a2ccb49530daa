"""What the host CPU computes fast, from the kernel's feature flags (/proc/cpuinfo)."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The first CPU's feature flags; empty where /proc/cpuinfo cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def cpu_has_fast_bf16() -> bool:
    """bfloat16 arithmetic in hardware: AVX512-BF16 dot products or AMX tiles."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def cpu_has_amx() -> bool:
    """AMX bfloat16 tiles, which oneDNN's and torch's blocked GEMMs use."""
    return "amx_bf16" in cpu_flags()
