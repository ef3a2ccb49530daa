"""The machine's GEMM rate and stream read bandwidth, measured for benchmarks/roofline.py.

GEMM: for bfloat16, the worker's own path (oneDNN: `mkldnn._reorder_linear_weight` once, then
`mkldnn._linear_pointwise` per call, worker_svc/layers/tp_layers.py); for float32, F.linear.
Each shape gets random weights and inputs of M rows, a warm-up call, then the best of a few
timed repeats of several calls. A set of shapes (a layer's projections) is reported as its
total flops over its total best time: the rate a layer would see.

Bandwidth: the best of several `sum` passes over a float32 buffer of at least 2 GiB and at
least 4x the L3 cache (lscpu), so the reads come from memory, not a cache.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Mapping
from typing import Any

GIB = 1 << 30
# The M the worker's packed layout is tuned for (worker_svc/layers/tp_layers.py).
PACK_BATCH_HINT = 64


def l3_bytes() -> int | None:
    """L3 size as lscpu reports it ("L3 cache: 480 MiB (1 instance)"), or None."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    match = re.search(r"^L3 cache:\s*([\d.]+)\s*([KMG])i?B", out, re.MULTILINE)
    if match is None:
        return None
    return int(float(match.group(1)) * {"K": 1 << 10, "M": 1 << 20, "G": GIB}[match.group(2)])


def read_bandwidth(min_bytes: int = 2 * GIB, repeats: int = 5) -> dict[str, Any]:
    """Bytes/s of the best `sum` over a buffer much larger than the L3."""
    import torch

    l3 = l3_bytes()
    size = max(min_bytes, 4 * l3) if l3 else min_bytes
    buffer = torch.ones(size // 4, dtype=torch.float32)  # written once: every page is resident
    buffer.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    del buffer
    return {"bytes": size, "l3_bytes": l3, "best_s": best, "bytes_per_s": size / best}


def _gemm(m: int, k: int, n: int, dtype: Any, min_s: float, repeats: int) -> float:
    """Best seconds of one [m, k] x [k, n] call."""
    import torch
    import torch.nn.functional as F

    weight = torch.randn(n, k, dtype=dtype) * 0.02
    x = torch.randn(m, k, dtype=dtype)
    if dtype == torch.bfloat16:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)

        def call() -> None:
            torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    else:

        def call() -> None:
            F.linear(x, weight)

    call()
    start = time.perf_counter()
    call()
    once = max(time.perf_counter() - start, 1e-6)
    calls = max(1, int(min_s / once))  # each repeat lasts about min_s
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def gemm_rate(
    shapes: Mapping[str, tuple[int, int]], m: int, dtype_name: str, min_s: float = 0.05, repeats: int = 3
) -> dict[str, Any]:
    """flop/s at M rows over `shapes` (name -> (in, out) features): each, and all together."""
    import torch

    dtype = getattr(torch, dtype_name)
    per_shape: dict[str, float] = {}
    total_flops = total_s = 0.0
    with torch.inference_mode():
        for name, (k, n) in shapes.items():
            seconds = _gemm(m, k, n, dtype, min_s, repeats)
            flops = 2.0 * m * k * n
            per_shape[name] = flops / seconds
            total_flops += flops
            total_s += seconds
    return {"m": m, "dtype": dtype_name, "flops_per_s": total_flops / total_s, "per_shape": per_shape}


def measure(
    layer_shapes: Mapping[str, tuple[int, int]], head_shape: tuple[int, int], dtype_name: str
) -> dict[str, Any]:
    """Everything the roofline needs (roofline.Peaks' fields), with the detail behind each."""
    prefill = gemm_rate(layer_shapes, 2048, dtype_name)
    decode = gemm_rate(layer_shapes, 96, dtype_name)
    head = gemm_rate({"lm_head": head_shape}, 96, dtype_name)
    stream = read_bandwidth()
    return {
        "linear_m2048": prefill["flops_per_s"],
        "linear_m96": decode["flops_per_s"],
        "head_m96": head["flops_per_s"],
        "read_bandwidth": stream["bytes_per_s"],
        "detail": {"gemm_m2048": prefill, "gemm_m96": decode, "lm_head_m96": head, "stream": stream},
    }
