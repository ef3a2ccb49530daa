"""What a runner's CUDA memory profile reads: the KV budget left beside the weights, the step's
peak and the decode graphs, and what a capture keeps reserved."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from kernels import workspace

T = TypeVar("T")


def kv_budget(total: int, free: int, allocated: int, utilization: float, step_peak: int, graph_pool: int) -> float:
    """Bytes for the KV cache: `utilization` of the device's `total`, less what is in use
    elsewhere (total - free - allocated, read after the probes with the caches emptied: other
    processes, the CUDA context), less `step_peak` (the weights and the heaviest step's peak),
    less `graph_pool` (what the decode graphs, captured after the cache, will hold); >= 0."""
    in_use_elsewhere = total - free - allocated
    return max(total * utilization - in_use_elsewhere - step_peak - graph_pool, 0.0)


def reserved_growth(device: torch.device, run: Callable[[], T]) -> tuple[T, int]:
    """`run()`'s result and the device memory torch reserves more after it, with both caches
    emptied: what it keeps (a graph's pool, a grown workspace), not what it used and freed."""
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(device)
    out = run()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return out, torch.cuda.memory_reserved(device) - before


def workspace_bytes(device: torch.device) -> int:
    buf = workspace.buffer(device)
    return 0 if buf is None else buf.numel() * buf.element_size()
