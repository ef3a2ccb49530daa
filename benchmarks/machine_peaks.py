"""The machine's GEMM rate and stream read bandwidth, measured for benchmarks/roofline.py.

GEMM: for bfloat16, the worker's own path (the weight packed once, kernels/cpu_linear.py: our
AVX512-BF16 kernel where the CPU has it, else oneDNN's); for float32, F.linear.
Each shape gets random weights and inputs of M rows, a warm-up call, then the best of a few
timed repeats of several calls. A set of shapes (a layer's projections) is reported as its
total flops over its total best time: the rate a layer would see.

Bandwidth: the best of several `sum` passes over a float32 buffer of at least 2 GiB and at
least 4x the L3 cache (lscpu), so the reads come from memory, not a cache.

Instruction peak: what the cores' multiply-add units give when nothing else limits them, the
ceiling of any GEMM: a loop of independent AVX512-BF16 `vdpbf16ps` (bfloat16, 64 flops each) or
AVX-512 `vfmadd` (float32, 32 flops each), compiled here with g++ -march=native and run on as
many OpenMP threads as torch uses. None where there is no compiler or no such instruction.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

GIB = 1 << 30


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
        from kernels.cpu_linear import PackedLinear

        packed = PackedLinear(weight)

        def call() -> None:
            packed(x)
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


# 24 independent accumulators: more than latency x issue width, so the loop is throughput-bound.
_PEAK_LOOP = r"""
#include <immintrin.h>
#include <omp.h>
#include <cstdio>
int main(int argc, char** argv) {
  const long iters = atol(argv[1]);
  float sink = 0;
  double t0 = omp_get_wtime();
#pragma omp parallel reduction(+ : sink)
  {
    __m512 a[24];
    for (int i = 0; i < 24; ++i) a[i] = _mm512_set1_ps(i);
    volatile int seed = 0x3f80;
#ifdef BF16
    const __m512bh x = (__m512bh)_mm512_set1_epi16(seed), y = (__m512bh)_mm512_set1_epi16(seed + 1);
#else
    const __m512 x = _mm512_set1_ps(seed * 1e-9f), y = _mm512_set1_ps(1.0f);
#endif
    for (long i = 0; i < iters; ++i) {
#pragma GCC unroll 24
      for (int j = 0; j < 24; ++j)
#ifdef BF16
        a[j] = _mm512_dpbf16_ps(a[j], x, y);
#else
        a[j] = _mm512_fmadd_ps(x, y, a[j]);
#endif
    }
    for (int i = 0; i < 24; ++i) sink += _mm512_reduce_add_ps(a[i]);
  }
  printf("%d %.6f %g\n", omp_get_max_threads(), omp_get_wtime() - t0, sink);
}
"""


def instruction_peak(dtype_name: str, iters: int = 100_000_000) -> float | None:
    """flop/s of the multiply-add loop above on torch's thread count (module docstring)."""
    import torch

    bf16 = dtype_name == "bfloat16"
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if "avx512f" not in flags or (bf16 and "avx512_bf16" not in flags):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "peak.cpp", Path(tmp) / "peak"
        src.write_text(_PEAK_LOOP)
        build = ["g++", "-O2", "-march=native", "-fopenmp", *(["-DBF16"] if bf16 else []), str(src), "-o", str(exe)]
        try:
            subprocess.run(build, check=True, capture_output=True, timeout=120)
            env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
            runs = [subprocess.run([str(exe), str(iters)], check=True, capture_output=True, text=True, env=env, timeout=120)
                    for _ in range(3)]  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            return None
    best = min(float(r.stdout.split()[1]) for r in runs)
    threads = int(runs[0].stdout.split()[0])
    return threads * iters * 24 * (64 if bf16 else 32) / best


def measure(
    layer_shapes: Mapping[str, tuple[int, int]], head_shape: tuple[int, int], dtype_name: str
) -> dict[str, Any]:
    """Everything the roofline needs (roofline.Peaks' fields), with the detail behind each."""
    prefill = gemm_rate(layer_shapes, 2048, dtype_name)
    decode = gemm_rate(layer_shapes, 96, dtype_name)
    head = gemm_rate({"lm_head": head_shape}, 96, dtype_name)
    stream = read_bandwidth()
    peak = instruction_peak(dtype_name)
    return {
        "linear_m2048": prefill["flops_per_s"],
        "linear_m96": decode["flops_per_s"],
        "head_m96": head["flops_per_s"],
        "read_bandwidth": stream["bytes_per_s"],
        "detail": {
            "gemm_m2048": prefill,
            "gemm_m96": decode,
            "lm_head_m96": head,
            "stream": stream,
            "instruction_peak_flops_per_s": peak,
        },
    }
