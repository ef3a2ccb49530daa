"""Every sequence's device block table mirrored into one flat int32 arena.

A plan's block tables are then one vectorised gather (`common.block_tables.gather_rows`) rather
than a Python loop over hundreds of lists, and, unlike a [sequences, widest table] matrix, the
arena's size follows the blocks held: one 1M-token sequence (65,536 blocks) costs its own
65,536 entries, not 65,536 for every row.

Each sequence owns a segment [start, start + capacity) of the arena. A table that outgrows its
segment moves to the arena's end with twice the room, so appends are amortised O(1); the holes
it leaves are reclaimed by compacting once they outweigh the live segments. A move changes the
sequence's start, so `epoch` counts moves: a caller holding starts re-reads them when it changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from common.block_tables import BlockTables, gather_rows

_MIN_SEGMENT = 4
_MIN_ARENA = 1024


class TableMirror:
    def __init__(self) -> None:
        self._arena = np.full(_MIN_ARENA, -1, dtype=np.int32)
        self._start: dict[int, int] = {}
        self._capacity: dict[int, int] = {}
        self._end = 0  # arena entries handed out so far
        self._holes = 0  # entries of released or moved segments
        self.epoch = 0  # bumped whenever a sequence's start changes

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._start

    def __len__(self) -> int:
        return len(self._start)

    def set(self, seq_id: int, table: Sequence[int]) -> None:
        """Mirror a whole table (a new sequence, a fork, a swap-in)."""
        self.set_range(seq_id, 0, table)

    def set_range(self, seq_id: int, first: int, blocks: Sequence[int]) -> None:
        """Entries [first, first + len(blocks)) of the sequence's table."""
        end = first + len(blocks)
        if seq_id not in self._start or end > self._capacity[seq_id]:
            self._reserve(seq_id, end)
        start = self._start[seq_id]
        self._arena[start + first : start + end] = blocks

    def set_one(self, seq_id: int, index: int, block: int) -> None:
        self._arena[self._start[seq_id] + index] = block

    def release(self, seq_id: int) -> None:
        start = self._start.pop(seq_id, None)
        if start is None:
            return
        self._holes += self._capacity.pop(seq_id)
        self.epoch += 1
        if not self._start:
            self._end = self._holes = 0
        elif self._holes > max(self._end - self._holes, _MIN_ARENA):
            self._compact()

    def starts_of(self, seq_ids: Sequence[int]) -> np.ndarray:
        """int64 arena starts of the sequences (valid until `epoch` moves)."""
        return np.array([self._start[s] for s in seq_ids], dtype=np.int64)

    def gather(self, starts: np.ndarray, lens: np.ndarray) -> BlockTables:
        """The first lens[k] blocks of the tables at starts[k]: work and size follow sum(lens)."""
        return BlockTables(*gather_rows(self._arena, starts, np.asarray(lens, dtype=np.int64)))

    def row(self, seq_id: int, length: int) -> list[int]:
        start = self._start[seq_id]
        return self._arena[start : start + length].tolist()

    @property
    def arena_size(self) -> int:
        return int(self._arena.shape[0])

    def _reserve(self, seq_id: int, needed: int) -> None:
        old = self._start.get(seq_id)
        old_capacity = self._capacity.get(seq_id, 0)
        capacity = max(needed, 2 * old_capacity, _MIN_SEGMENT)
        if self._end + capacity > self._arena.shape[0]:
            live = self._end - self._holes
            if self._holes and live + capacity <= self._arena.shape[0] // 2:
                self._compact()
                old = self._start.get(seq_id)
            if self._end + capacity > self._arena.shape[0]:
                grown = np.full(max(2 * self._arena.shape[0], self._end + capacity), -1, dtype=np.int32)
                grown[: self._end] = self._arena[: self._end]
                self._arena = grown
        start = self._end
        if old is not None:
            self._arena[start : start + old_capacity] = self._arena[old : old + old_capacity]
            self._holes += old_capacity
        self._start[seq_id], self._capacity[seq_id] = start, capacity
        self._end += capacity
        self.epoch += 1

    def _compact(self) -> None:
        """Move every live segment to the front, in start order, dropping the holes."""
        arena = np.full(max(_MIN_ARENA, 2 * (self._end - self._holes)), -1, dtype=np.int32)
        at = 0
        for seq_id, start in sorted(self._start.items(), key=lambda item: item[1]):
            capacity = self._capacity[seq_id]
            arena[at : at + capacity] = self._arena[start : start + capacity]
            self._start[seq_id] = at
            at += capacity
        self._arena, self._end, self._holes = arena, at, 0
        self.epoch += 1
