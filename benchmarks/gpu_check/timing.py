"""Seconds per call of a GPU function, measured so that neither launch overhead nor a warm L2
cache stands in for the kernel's own speed.

Timing one eager call brackets its Python and launch overhead (tens of microseconds, as long
as a small decode), and a case whose data fits in the 50-60 MB L2 cache is read from there on
every iteration after the first. So each timed iteration is `calls` back-to-back calls (or one
replay of a CUDA graph holding them) between two CUDA events, and before each iteration a
buffer larger than L2 is written, evicting whatever the previous iteration left there.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

FLUSH_BYTES = 256 << 20  # several times the L2 of any current GPU (H200: 60 MB)


class L2Flush:
    def __init__(self, device: torch.device, nbytes: int = FLUSH_BYTES) -> None:
        if device.type == "cuda":
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)  # absent in older torch
            nbytes = max(nbytes, 4 * l2)
        else:
            nbytes = min(nbytes, 1 << 20)  # a CPU run checks the code path, not the cache
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.value = 0

    def __call__(self) -> None:
        self.value = (self.value + 1) % 256  # a new value each time: no write can be skipped
        self.buffer.fill_(self.value)


def per_call_seconds(
    fn: Callable[[], object],
    device: torch.device,
    flush: L2Flush,
    calls: int,
    iters: int,
    graph: bool = False,
) -> float:
    """Median over `iters` iterations of the seconds one of `calls` back-to-back calls takes.

    `graph`: the calls are captured once into a CUDA graph and each iteration replays it, so
    the host launches nothing per call. The first call runs eagerly before anything is timed
    or captured: Triton compiles there, and a kernel's scratch buffers grow there (a capture
    must not allocate them)."""
    fn()
    if device.type != "cuda":
        if graph:
            raise ValueError("CUDA graphs need a CUDA device")
        return _cpu_seconds(fn, flush, calls, iters)
    torch.cuda.synchronize(device)
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            for _ in range(calls):
                fn()
        captured.replay()  # the first replay uploads the graph: not part of any iteration

        def run() -> None:
            captured.replay()
    else:

        def run() -> None:
            for _ in range(calls):
                fn()

    times = []
    for _ in range(iters):
        flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def _cpu_seconds(fn: Callable[[], object], flush: L2Flush, calls: int, iters: int) -> float:
    times = []
    for _ in range(iters):
        flush()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int, flush: L2Flush, iters: int) -> float:
    """Bytes per second a device-to-device copy moves, counting each byte read and written:
    the ceiling a memory-bound kernel is held against."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / per_call_seconds(lambda: dst.copy_(src), device, flush, calls=5, iters=iters)


def matmul_peak(device: torch.device, n: int, flush: L2Flush, iters: int) -> float:
    """FLOP/s of an n x n x n bfloat16 product on random data: what dense tensor-core work
    reaches here, the ceiling prefill attention is held against."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    return 2 * n**3 / per_call_seconds(lambda: torch.matmul(a, b, out=out), device, flush, calls=5, iters=iters)
