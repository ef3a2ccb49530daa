"""The block tables of one step, ragged: every row as long as its own sequence's table.

A dense [num_seqs, widest row] array would let one long sequence set the size of every row: a
1M-token sequence (65,536 blocks of 16) beside 255 short ones would make 64 MiB of mostly -1
each step. Here the size is the blocks actually referenced:

    ids      [ 7 2 9 | 4 | 3 8 ]       int32, row after row
    offsets  [ 0     3   4     6 ]     int32 [num_seqs + 1]: row i is ids[offsets[i]:offsets[i+1]]

The kernels take the same two arrays (row i's j-th block at ids[offsets[i] + j]), so nothing on
the way from the scheduler's mirror to the attention kernels pads a row to another's width.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

I32 = npt.NDArray[np.int32]
I64 = npt.NDArray[np.int64]


def _empty_offsets() -> I32:
    return np.zeros(1, np.int32)


def _no_ids() -> I32:
    return np.zeros(0, np.int32)


@dataclass(frozen=True)
class BlockTables:
    offsets: I32 = field(default_factory=_empty_offsets)  # [num_rows + 1], rising from 0 to ids.size
    ids: I32 = field(default_factory=_no_ids)  # [offsets[-1]] physical block ids, row after row

    @classmethod
    def from_rows(cls, rows: Sequence[Sequence[int]]) -> BlockTables:
        lens = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        offsets = np.zeros(len(rows) + 1, np.int32)
        np.cumsum(lens, out=offsets[1:])
        ids = np.fromiter((b for r in rows for b in r), dtype=np.int32, count=int(offsets[-1]))
        return cls(offsets, ids)

    @classmethod
    def from_dense(cls, dense: np.ndarray) -> BlockTables:
        """Rows of a [n, width] array padded with -1: each row ends at its first -1."""
        dense = np.asarray(dense, dtype=np.int32).reshape(len(dense), -1)
        valid = dense >= 0
        lens = np.where(valid.all(axis=1), dense.shape[1], np.argmin(valid, axis=1))
        keep = np.arange(dense.shape[1])[None, :] < lens[:, None]
        offsets = np.zeros(len(dense) + 1, np.int32)
        np.cumsum(lens, out=offsets[1:])
        return cls(offsets, np.ascontiguousarray(dense[keep]))

    @classmethod
    def whole_rows(cls, dense: np.ndarray) -> BlockTables:
        """Every row of a [n, width] array whole, -1 entries included (rows may run past the
        blocks their sequences use: probes size kernels by a row's length this way)."""
        n, width = dense.shape
        return cls(np.arange(n + 1, dtype=np.int32) * width, np.ascontiguousarray(dense, np.int32).reshape(-1))

    @property
    def num_rows(self) -> int:
        return int(self.offsets.shape[0]) - 1

    @property
    def lens(self) -> I32:
        """int32 [num_rows]: blocks in each row."""
        return np.diff(self.offsets).astype(np.int32)

    @property
    def max_len(self) -> int:
        return int(self.lens.max()) if self.num_rows > 0 else 0

    def row(self, i: int) -> I32:
        return self.ids[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def lookup(self, rows: np.ndarray, blocks: np.ndarray) -> I64:
        """int64 ids of block `blocks[k]` of row `rows[k]` (the caller keeps blocks inside rows)."""
        return self.ids[self.offsets[rows].astype(np.int64) + blocks].astype(np.int64)

    def take(self, rows: np.ndarray, lens: np.ndarray | None = None) -> BlockTables:
        """The rows `rows`, in that order, each cut to `lens[k]` blocks when given (no longer
        than the row). One vectorised gather: its cost follows the blocks taken."""
        rows = np.asarray(rows, dtype=np.int64)
        starts = self.offsets[rows].astype(np.int64)
        take = self.offsets[rows + 1] - starts if lens is None else np.asarray(lens, dtype=np.int64)
        return BlockTables(*gather_rows(self.ids, starts, take))

    def dense(self, width: int | None = None, fill: int = -1) -> I32:
        """int32 [num_rows, width] padded with `fill`, for reference paths and tests only."""
        lens = self.lens
        width = self.max_len if width is None else width
        if width < self.max_len:
            raise ValueError(f"a dense width of {width} is narrower than the longest row ({self.max_len})")
        out = np.full((self.num_rows, width), fill, np.int32)
        out[np.arange(width)[None, :] < lens[:, None]] = self.ids
        return out

    def validate(self, num_rows: int) -> None:
        o = self.offsets
        if o.ndim != 1 or o.shape[0] != num_rows + 1:
            raise ValueError(f"plan.block_tables.offsets has shape {o.shape}, want ({num_rows + 1},)")
        if int(o[0]) != 0 or int(o[-1]) != self.ids.size or (num_rows and bool((np.diff(o) < 0).any())):
            raise ValueError("plan.block_tables.offsets must rise from 0 to the number of block ids")


def gather_rows(flat: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> tuple[I32, I32]:
    """(offsets, ids) of rows flat[starts[k] : starts[k] + lens[k]], concatenated."""
    offsets = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    total = int(offsets[-1])
    index = np.arange(total, dtype=np.int64) + np.repeat(np.asarray(starts, np.int64) - offsets[:-1], lens)
    return offsets.astype(np.int32), np.ascontiguousarray(flat[index], dtype=np.int32)
