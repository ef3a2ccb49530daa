"""Block manager: exact block ids, FIFO reuse order, and the integrity invariant."""

from __future__ import annotations

import pytest

from scheduler_svc.block_manager import BlockManager


def test_allocate_takes_ids_in_order_and_grows_by_whole_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate(seq_id=1, num_tokens=5)  # 2 blocks
    bm.allocate(seq_id=2, num_tokens=4)  # 1 block
    assert bm.block_table(1) == [0, 1]
    assert bm.block_table(2) == [2]
    bm.allocate(seq_id=1, num_tokens=8)  # still 2 blocks: no change
    assert bm.block_table(1) == [0, 1]
    bm.allocate(seq_id=1, num_tokens=9)  # a third block
    assert bm.block_table(1) == [0, 1, 3]
    assert bm.num_free_blocks == 4
    bm.check_integrity()


def test_freed_blocks_are_reused_after_the_never_used_ones() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    bm.allocate(1, 4)  # [0, 1]
    bm.allocate(2, 2)  # [2]
    assert bm.free(1) == 2
    bm.allocate(3, 6)  # free queue was [3, 4, 5, 0, 1]
    assert bm.block_table(3) == [3, 4, 5]
    bm.allocate(4, 3)
    assert bm.block_table(4) == [0, 1]
    assert bm.num_free_blocks == 0
    bm.check_integrity()


def test_can_allocate_counts_only_missing_blocks_and_the_reserve() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate(1, 4)
    assert bm.blocks_needed(1, 12) == 2
    assert bm.can_allocate(1, 16)  # needs 3, 3 free
    assert not bm.can_allocate(1, 16, reserve=1)
    assert not bm.can_allocate(2, 17)
    with pytest.raises(RuntimeError, match="needs 5 blocks"):
        bm.allocate(2, 17)
    bm.check_integrity()  # a refused allocation changes nothing


def test_free_of_unknown_sequence_is_harmless() -> None:
    bm = BlockManager(num_blocks=2, block_size=16)
    assert bm.free(42) == 0
    bm.check_integrity()


def test_integrity_check_catches_a_double_owner() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate(1, 4)
    bm._tables[2] = list(bm.block_table(1))  # corrupt on purpose
    with pytest.raises(AssertionError):
        bm.check_integrity()


def test_blocks_for() -> None:
    bm = BlockManager(num_blocks=1, block_size=16)
    assert [bm.blocks_for(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
    with pytest.raises(ValueError):
        BlockManager(num_blocks=0, block_size=16)
