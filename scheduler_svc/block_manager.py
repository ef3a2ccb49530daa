"""Paged KV-cache accounting: which physical blocks each sequence owns.

The scheduler owns all capacity; workers only hold tensors. A block holds `block_size`
consecutive tokens of one sequence; a sequence of n tokens owns ceil(n / block_size) blocks:

    tokens     0 ........ 15 | 16 ....... 31 | 32 .. 37
    table      [    7        ,      2        ,    9     ]   (physical ids, any order)
    slot of token t = table[t // block_size] * block_size + t % block_size

Free ids sit in a FIFO: allocation takes from the left, freeing appends on the right, so the
order in which blocks are reused is predictable (tests assert exact ids).
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[int, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a sequence of `num_tokens` tokens occupies."""
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: int) -> list[int]:
        return self._tables.get(seq_id, [])

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """Blocks to add so that `seq_id` can hold `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(self._tables.get(seq_id, ())))

    def can_allocate(self, seq_id: int, num_tokens: int, reserve: int = 0) -> bool:
        """Whether `allocate(seq_id, num_tokens)` succeeds and leaves `reserve` blocks free."""
        return self.blocks_needed(seq_id, num_tokens) + reserve <= len(self._free)

    def allocate(self, seq_id: int, num_tokens: int) -> None:
        """Grow the table of `seq_id` (created if new) to hold `num_tokens` tokens."""
        needed = self.blocks_needed(seq_id, num_tokens)
        if needed > len(self._free):
            raise RuntimeError(f"allocate: seq {seq_id} needs {needed} blocks, {len(self._free)} free")
        table = self._tables.setdefault(seq_id, [])
        for _ in range(needed):
            table.append(self._free.popleft())

    def free(self, seq_id: int) -> int:
        """Return every block of `seq_id` to the pool; returns how many. Unknown ids free nothing."""
        table = self._tables.pop(seq_id, [])
        self._free.extend(table)
        return len(table)

    def check_integrity(self) -> None:
        """free + used = total, and no block is in two places."""
        used = [b for table in self._tables.values() for b in table]
        seen = set(self._free)
        if len(seen) != len(self._free):
            raise AssertionError("a block appears twice in the free queue")
        if seen & set(used) or len(set(used)) != len(used):
            raise AssertionError("a block is both free and used, or used twice")
        if len(self._free) + len(used) != self.num_blocks:
            raise AssertionError(f"free {len(self._free)} + used {len(used)} != total {self.num_blocks}")
        if any(not 0 <= b < self.num_blocks for b in seen | set(used)):
            raise AssertionError("block id out of range")
