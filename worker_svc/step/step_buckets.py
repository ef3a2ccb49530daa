"""Step sizes rounded up to a few buckets.

Two things key their work on the exact number of rows of a step:

  - oneDNN builds (JIT-compiles) a GEMM primitive per input shape and caches it; a batch that
    shrinks by a row or two every step would build a new one for every layer shape each time
    (measured here: ~9 ms a step, on the CPU worker's critical path). Where our own bfloat16
    GEMM runs the linears (kernels/cpu_linear.py) nothing is built per shape, and a CPU step
    runs its rows unpadded;
  - a CUDA graph replays fixed shapes, so decode steps run in the graph captured for the
    smallest bucket that holds them (worker_svc/step/cuda_graphs.py).

Padding rows are inert: their token is 0 at position 0, their KV slot is -1 (nothing is
stored), no sequence's attention reads them, and their outputs are dropped.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Buckets:
    sizes: tuple[int, ...]  # ascending

    def __post_init__(self) -> None:
        if not self.sizes or list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] < 1:
            raise ValueError(f"bucket sizes must be distinct, ascending and positive, got {self.sizes}")

    @property
    def largest(self) -> int:
        return self.sizes[-1]

    def fit(self, n: int) -> int | None:
        """The smallest bucket that holds n rows, or None beyond the largest."""
        i = bisect.bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) else None

    def pad(self, n: int) -> int:
        """Rows to run n rows as: the bucket that holds them, or n itself beyond the largest."""
        return self.fit(n) or n


def gemm_buckets(max_rows: int) -> Buckets:
    """Row counts for the CPU's GEMMs: 2, 4, 8, multiples of 16 to 256, then multiples of 128,
    up to max_rows. A decode batch pads by at most 15 rows (its GEMMs read the weights once
    whatever the rows), a long prefill by at most 127.

    Never one row: oneDNN's bfloat16 GEMM of a single row (a matrix-vector kernel) rounds some
    outputs differently from its kernels for two or more, where a row's result does not depend
    on the others. A lone decode then gave other bits than the same position verified among a
    speculative step's rows, and greedy outputs with and without drafts parted at near ties."""
    sizes = [2, 4, 8, *range(16, 257, 16)]
    sizes += range(384, max(max_rows, 256) + 128, 128)
    return Buckets(tuple(s for s in sizes if s <= max(max_rows, 2)))


def graph_buckets(max_seqs: int) -> Buckets:
    """Decode batch sizes to capture CUDA graphs for: 1, 2, 4, then every multiple of 8 up to
    max_seqs (vLLM's choice: capture is cheap, padding a decode by < 8 rows costs little)."""
    sizes = [s for s in (1, 2, 4) if s <= max_seqs] + list(range(8, max_seqs + 1, 8))
    if sizes[-1] != max_seqs:
        sizes.append(max_seqs)
    return Buckets(tuple(sizes))


def pad_rows(a: np.ndarray, rows: int, fill: int | float) -> np.ndarray:
    """`a` with its first dimension padded to `rows` with `fill`."""
    if a.shape[0] == rows:
        return a
    out = np.full((rows, *a.shape[1:]), fill, dtype=a.dtype)
    out[: a.shape[0]] = a
    return out
