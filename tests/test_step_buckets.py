"""Bucket sizes of the CPU GEMMs and of CUDA graphs, and padding."""

from __future__ import annotations

import numpy as np
import pytest

from worker_svc.step.step_buckets import Buckets, gemm_buckets, graph_buckets, pad_rows


def test_gemm_buckets() -> None:
    b = gemm_buckets(2048)
    assert b.sizes[:8] == (2, 4, 8, 16, 32, 48, 64, 80) and b.largest == 2048
    assert [b.pad(n) for n in (1, 3, 9, 17, 64, 65, 256, 257, 2000, 2048)] == [
        2,  # never one row: oneDNN's single-row kernel rounds otherwise (step_buckets.gemm_buckets)
        4,
        16,
        32,
        64,
        80,
        256,
        384,
        2048,
        2048,
    ]
    assert b.pad(5000) == 5000  # beyond the largest: as it is
    assert all(b.pad(n) - n < 128 for n in range(1, 2049))
    assert gemm_buckets(100).largest == 96 and gemm_buckets(1).sizes == (2,)


def test_graph_buckets() -> None:
    assert graph_buckets(256).sizes[:6] == (1, 2, 4, 8, 16, 24) and graph_buckets(256).largest == 256
    assert graph_buckets(20).sizes == (1, 2, 4, 8, 16, 20)
    assert graph_buckets(3).sizes == (1, 2, 3)
    b = graph_buckets(64)
    assert b.fit(9) == 16 and b.fit(64) == 64 and b.fit(65) is None


@pytest.mark.parametrize("sizes", [(), (2, 1), (1, 1), (0, 4)])
def test_bad_buckets(sizes: tuple[int, ...]) -> None:
    with pytest.raises(ValueError):
        Buckets(sizes)


def test_pad_rows() -> None:
    a = np.arange(6, dtype=np.int32).reshape(3, 2)
    assert pad_rows(a, 3, -1) is a
    out = pad_rows(a, 5, -1)
    assert out.dtype == np.int32 and out.tolist() == [[0, 1], [2, 3], [4, 5], [-1, -1], [-1, -1]]
