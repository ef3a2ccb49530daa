"""How much host memory a worker may take by default, from what the machine has free.

A CPU worker's KV pool and every worker's swap pool live in host memory. Fixed defaults
(2 GiB of KV, 4 GiB of swap) reserved 6 GiB for a 135M model on a laptop; these take the
same sizes where memory is plentiful and a share of what is available where it is not.
"""

from __future__ import annotations

import os
from pathlib import Path

GIB = 1024**3
CPU_KV_GIB = 2.0  # at most, by default, on a CPU worker
CPU_KV_SHARE = 0.3  # of the available memory
SWAP_GIB = {"cuda": 4.0, "cpu": 1.0}  # at most, by default (vLLM's is 4 GiB on every device)
SWAP_SHARE = 0.1


def available_bytes() -> int:
    """MemAvailable (free plus reclaimable cache) on Linux; free pages elsewhere."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_cpu_kv_bytes(available: int) -> float:
    return min(CPU_KV_GIB * GIB, CPU_KV_SHARE * available)


def default_swap_bytes(device_type: str, available: int) -> float:
    """Swap pool on the host. On a CPU worker it is the same memory as the KV pool, so a
    preempted sequence's blocks only move across the process: kept small."""
    return min(SWAP_GIB.get(device_type, SWAP_GIB["cuda"]) * GIB, SWAP_SHARE * available)
