"""BlockManager: exact block ids, free-queue order, copy-on-write, swapping and prefix caching.

Covers, each with exact physical ids:
  - growth by whole blocks, can_allocate with a reserve, refused allocations changing nothing;
  - free() releasing in reverse, and the take order that follows;
  - fork + copy-on-write (partly filled shared blocks are copied once, full ones never);
  - swap out / in: host ids, the (src, dst) pairs of take_ops, shared blocks moving once;
  - prefix caching: chain hashes, longest hit, one token always left, the cached LRU and its
    eviction order (tail before head), caching off;
  - the block-table mirror (padding, no stale ids), check_integrity catching corruption;
  - a hypothesis state machine that mirrors the KV contents each block would hold and checks,
    after every operation, that every computed token still reads back from its sequence's
    blocks (so a wrong hit, a missed copy or a lost swap shows up as wrong data).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from scheduler_svc.kv.block_manager import BlockManager

BS = 4
# Distinct 4-token blocks for prefix tests (one block each).
A, B, C, D = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]
X = [99, 98, 97, 96]


def ops(bm: BlockManager) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """take_ops() as plain lists: (swap_out, swap_in, copy)."""
    swap_out, swap_in, copy = bm.take_ops()
    for pairs in (swap_out, swap_in, copy):
        assert pairs.dtype == np.int32 and pairs.ndim == 2 and pairs.shape[1] == 2
    return swap_out.tolist(), swap_in.tolist(), copy.tolist()


def refs(bm: BlockManager, blocks: list[int]) -> list[int]:
    return [bm.device.ref[b] for b in blocks]


def admit(bm: BlockManager, seq_id: int, tokens: list[int]) -> list[int]:
    """What the scheduler does for a new sequence: hit, attach, allocate the rest."""
    hit = bm.prefix_hit(seq_id, tokens)
    bm.attach(seq_id, hit)
    bm.allocate(seq_id, len(tokens), write_from=len(hit) * bm.block_size)
    return hit


def prefill(bm: BlockManager, seq_id: int, tokens: list[int]) -> None:
    """Admit and compute the whole prompt but its last token (which a decode step feeds)."""
    admit(bm, seq_id, tokens)
    bm.commit(seq_id, tokens, len(tokens) - 1)


# ---------------------------------------------------------------- allocate / free


def test_allocate_takes_ids_in_order_and_grows_by_whole_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate(seq_id=1, num_tokens=5)
    bm.allocate(seq_id=2, num_tokens=4)
    assert bm.block_table(1) == [0, 1]
    assert bm.block_table(2) == [2]
    bm.allocate(seq_id=1, num_tokens=8)  # still 2 blocks
    assert bm.block_table(1) == [0, 1]
    bm.allocate(seq_id=1, num_tokens=9)
    assert bm.block_table(1) == [0, 1, 3]
    bm.allocate(seq_id=1, num_tokens=3)  # never shrinks
    assert bm.block_table(1) == [0, 1, 3]
    assert bm.num_free_blocks == 4 and bm.num_used_blocks == 4
    assert bm.device.free_order() == [4, 5, 6, 7]
    bm.check_integrity()


def test_can_allocate_counts_missing_blocks_and_the_reserve() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate(1, 4)
    assert bm.blocks_needed(1, 12) == 2
    assert bm.can_allocate(1, 16)  # needs 3, 3 free
    assert not bm.can_allocate(1, 16, reserve=1)
    assert not bm.can_allocate(2, 17)


def test_refused_allocation_changes_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate(1, 4)
    before = bm.device.free_order()
    with pytest.raises(RuntimeError, match="needs 5 blocks, 3 free"):
        bm.allocate(2, 17)
    with pytest.raises(RuntimeError, match="needs 4 blocks, 3 free"):
        bm.allocate(1, 20)
    assert bm.block_table(1) == [0] and bm.block_table(2) == []
    assert bm.device.free_order() == before == [1, 2, 3]
    assert ops(bm) == ([], [], [])
    bm.check_integrity()


def test_free_of_unknown_sequence_is_harmless() -> None:
    bm = BlockManager(num_blocks=2, block_size=16)
    assert bm.free(42) == 0
    bm.drop_device_blocks(43)
    assert bm.device.free_order() == [0, 1]
    bm.check_integrity()


def test_blocks_for_and_validation() -> None:
    bm = BlockManager(num_blocks=1, block_size=16)
    assert [bm.blocks_for(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
    with pytest.raises(ValueError):
        BlockManager(num_blocks=0, block_size=16)


def test_free_releases_in_reverse_after_the_never_used_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    bm.allocate(1, 6)  # [0, 1, 2]
    bm.allocate(2, 2)  # [3]
    assert bm.free(1) == 3
    assert bm.device.free_order() == [4, 5, 6, 7, 2, 1, 0]
    bm.allocate(3, 10)
    assert bm.block_table(3) == [4, 5, 6, 7, 2]
    bm.allocate(4, 4)
    assert bm.block_table(4) == [1, 0]
    assert bm.num_free_blocks == 0
    bm.check_integrity()


# ---------------------------------------------------------------- fork / copy-on-write


def test_fork_shares_every_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate(1, 6)  # [0, 1*], block 1 holds 2 of 4 tokens
    bm.fork(1, 2)
    assert bm.block_table(2) == [0, 1]
    assert refs(bm, [0, 1]) == [2, 2]
    assert bm.num_used_blocks == 2
    bm.check_integrity()
    bm.free(1)  # the child keeps both blocks
    assert refs(bm, [0, 1]) == [1, 1]
    assert bm.device.free_order() == [2, 3, 4, 5, 6, 7]
    bm.check_integrity()


def test_writing_into_a_shared_partial_block_copies_it_then_the_owner_writes_in_place() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate(1, 6)
    bm.fork(1, 2)
    assert bm.blocks_needed(2, 7, write_from=6) == 1  # the copy
    bm.allocate(2, 7, write_from=6)
    assert bm.block_table(2) == [0, 2]
    assert bm.block_table(1) == [0, 1]
    assert refs(bm, [0, 1, 2]) == [2, 1, 1]
    assert ops(bm) == ([], [], [[1, 2]])
    # The parent is now the only owner of block 1: it writes in place.
    assert bm.blocks_needed(1, 7, write_from=6) == 0
    bm.allocate(1, 7, write_from=6)
    assert bm.block_table(1) == [0, 1]
    assert ops(bm) == ([], [], [])
    assert bm.block_tables([1, 2]).dense().tolist() == [[0, 1], [0, 2]]
    bm.check_integrity()


def test_full_shared_blocks_are_never_copied() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate(1, 8)  # [0, 1], both full
    bm.fork(1, 2)
    assert bm.blocks_needed(2, 9, write_from=8) == 1  # growth only
    bm.allocate(2, 9, write_from=8)
    assert bm.block_table(2) == [0, 1, 2]
    assert refs(bm, [0, 1, 2]) == [2, 2, 1]
    assert ops(bm) == ([], [], [])
    bm.check_integrity()


def test_blocks_needed_counts_copies_and_growth() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate(1, 6)  # [0, 1*]
    bm.fork(1, 2)
    bm.fork(1, 3)
    assert refs(bm, [0, 1]) == [3, 3]
    assert bm.blocks_needed(2, 9, write_from=6) == 2  # copy of 1 + block 3
    assert bm.blocks_needed(2, 9) == 1  # write_from None: no copy-on-write check
    bm.allocate(2, 9, write_from=6)
    assert bm.block_table(2) == [0, 2, 3]  # the copy is taken before the growth
    bm.allocate(3, 7, write_from=6)
    assert bm.block_table(3) == [0, 4]
    assert ops(bm)[2] == [[1, 2], [1, 4]]
    assert refs(bm, [0, 1, 2, 3, 4]) == [3, 1, 1, 1, 1]
    assert bm.blocks_needed(1, 7, write_from=6) == 0
    bm.check_integrity()


# ---------------------------------------------------------------- swapping


def test_swap_out_and_in_use_exact_ids_and_record_pairs() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, num_host_blocks=4)
    bm.allocate(1, 6)  # [0, 1]
    bm.allocate(2, 4)  # [2]
    assert bm.can_swap_out([2])
    assert bm.swap_out([2]) == 1
    assert bm.swap_out([1]) == 2
    assert bm.host_table(2) == [0] and bm.host_table(1) == [1, 2]
    assert bm.block_table(1) == [] and bm.block_table(2) == []
    assert bm.device.free_order() == [3, 4, 5, 6, 7, 2, 0, 1]  # swap-out releases in table order
    assert ops(bm) == ([[2, 0], [0, 1], [1, 2]], [], [])
    assert ops(bm) == ([], [], [])  # take_ops clears
    bm.check_integrity()

    assert bm.can_swap_in([1])
    assert bm.swap_in([1]) == 2
    assert bm.block_table(1) == [3, 4] and bm.host_table(1) == []
    assert bm.host.free_order() == [3, 1, 2]
    assert ops(bm) == ([], [[1, 3], [2, 4]], [])
    assert bm.block_tables([1]).dense().tolist() == [[3, 4]]
    bm.check_integrity()


def test_forks_swap_together_and_shared_blocks_move_once() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, num_host_blocks=4)
    bm.allocate(9, 8)  # [0, 1]: keeps the low device ids busy
    bm.allocate(1, 6)  # [2, 3*]
    bm.fork(1, 2)
    bm.allocate(2, 7, write_from=6)  # child copies 3 -> 4
    assert bm.block_table(2) == [2, 4]
    ops(bm)
    assert bm.unique_blocks([1, 2]) == {2, 3, 4}
    assert bm.swap_out([1, 2]) == 3
    assert bm.host_table(1) == [0, 1] and bm.host_table(2) == [0, 2]
    assert [bm.host.ref[b] for b in range(4)] == [2, 1, 1, 0]
    assert ops(bm) == ([[2, 0], [3, 1], [4, 2]], [], [])
    assert bm.device.free_order() == [5, 6, 7, 3, 2, 4]
    bm.check_integrity()

    assert bm.swap_in([1, 2]) == 3
    assert bm.block_table(1) == [5, 6] and bm.block_table(2) == [5, 7]
    assert refs(bm, [5, 6, 7]) == [2, 1, 1]
    assert ops(bm) == ([], [[0, 5], [1, 6], [2, 7]], [])
    assert bm.host.free_order() == [3, 1, 0, 2]
    assert bm.block_tables([1, 2, 9]).dense().tolist() == [[5, 6], [5, 7], [0, 1]]
    bm.check_integrity()


def test_swap_capacity_checks() -> None:
    bm = BlockManager(num_blocks=4, block_size=4, num_host_blocks=2)
    bm.allocate(1, 12)  # [0, 1, 2]
    assert not bm.can_swap_out([1])
    before = bm.device.free_order()
    with pytest.raises(RuntimeError, match="swap_out"):
        bm.swap_out([1])
    assert bm.block_table(1) == [0, 1, 2] and bm.host_table(1) == []
    assert bm.device.free_order() == before and ops(bm) == ([], [], [])
    bm.check_integrity()

    bm.free(1)
    bm.allocate(2, 8)  # [3, 2]
    bm.fork(2, 3)
    assert bm.can_swap_out([2, 3])  # 2 unique blocks fit 2 host blocks
    bm.swap_out([2, 3])
    bm.allocate(4, 8)  # 2 of 4 device blocks left free
    assert bm.can_swap_in([2, 3])
    assert not bm.can_swap_in([2, 3], reserve=1)
    # Freeing a swapped sequence releases its host blocks.
    assert bm.free(2) == 0 and bm.host.num_free == 0
    assert bm.free(3) == 0 and bm.host.num_free == 2
    bm.check_integrity()


# ---------------------------------------------------------------- prefix caching


def test_commit_indexes_full_computed_blocks_only() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = A + B + [7, 7]
    admit(bm, 1, tokens)  # [0, 1, 2]
    bm.commit(1, tokens, 3)  # no full block computed yet
    assert bm.prefix_hit(10, tokens) == []
    bm.commit(1, tokens, 6)
    assert bm.prefix_hit(11, tokens) == [0]
    bm.commit(1, tokens, 10)  # block 2 holds 2 of 4 tokens: never indexed
    assert bm.prefix_hit(12, tokens + [7, 7, 1]) == [0, 1]
    bm.check_integrity()


def test_second_sequence_hits_the_longest_prefix() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    prefill(bm, 1, A + B + C + [5])  # [0, 1, 2, 3]; A, B, C indexed
    hit = bm.prefix_hit(2, A + B + [6])
    assert hit == [0, 1]
    assert bm.admission_cost(hit, 9) == 1  # nothing revived: one new block
    bm.attach(2, hit)
    bm.allocate(2, 9, write_from=8)
    assert bm.block_table(2) == [0, 1, 4]
    assert refs(bm, [0, 1, 2, 3, 4]) == [2, 2, 1, 1, 1]
    bm.check_integrity()


def test_a_prompt_of_whole_blocks_leaves_its_last_block_to_compute() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    prefill(bm, 1, A + B + C + [5])
    assert bm.prefix_hit(2, A + B + C) == [0, 1]  # 12 tokens: 3 indexed blocks, 2 hit
    assert bm.prefix_hit(3, A + B + C + [0]) == [0, 1, 2]


def test_the_hit_leaves_a_token_to_compute_even_when_all_blocks_are_indexed() -> None:
    # Seq 1 computed its whole 8-token prompt (both blocks indexed), then lost its blocks to
    # a recompute preemption before the sampled token was appended.
    bm = BlockManager(num_blocks=8, block_size=4)
    admit(bm, 1, A + B)
    bm.commit(1, A + B, 8)
    bm.drop_device_blocks(1)
    assert bm.prefix_hit(1, A + B) == [0]
    assert bm.prefix_hit(2, A + B) == [0]


def test_the_chain_stops_at_the_first_different_block() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    prefill(bm, 1, A + B + C + [0])  # [0, 1, 2, 3]
    assert bm.prefix_hit(2, A + X + C + [0]) == [0]
    assert bm.prefix_hit(3, X + B + C + [0]) == []


def test_a_changed_earlier_block_changes_every_later_hash() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    prefill(bm, 1, A + B + C + [0])  # [0, 1, 2, 3]
    prefill(bm, 2, X + B + C + [0])  # [4, 5, 6, 7]
    # Blocks 5 and 6 hold the same tokens as 1 and 2, but behind a different parent they
    # hash differently, so they were indexed rather than deduplicated onto 1 and 2.
    assert bm.prefix_hit(3, X + B + C + [1]) == [4, 5, 6]
    assert bm.prefix_hit(4, A + B + C + [1]) == [0, 1, 2]


def test_freed_blocks_stay_hitable_in_the_cached_lru() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    prefill(bm, 1, A + B + [1, 2])  # [0, 1, 2]; A, B indexed
    bm.free(1)
    assert bm.device.num_cached == 2
    assert bm.device.free_order() == [3, 4, 5, 6, 7, 2, 1, 0]  # free FIFO, then LRU (tail first)
    hit = bm.prefix_hit(2, A + B + [3, 4])
    assert hit == [0, 1]
    assert bm.admission_cost(hit, 10) == 3  # two revived + one new
    free_before = bm.num_free_blocks
    bm.attach(2, hit)
    bm.allocate(2, 10, write_from=8)
    assert free_before - bm.num_free_blocks == 3
    assert bm.block_table(2) == [0, 1, 3]
    assert bm.device.num_cached == 0
    bm.check_integrity()


def test_drop_device_blocks_keeps_the_hashes_for_a_later_hit() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = A + B + [1, 2]
    prefill(bm, 1, tokens)  # [0, 1, 2]
    bm.drop_device_blocks(1)
    assert bm.block_table(1) == []
    assert bm.device.free_order() == [3, 4, 5, 6, 7, 2, 1, 0]
    assert admit(bm, 1, tokens) == [0, 1]
    assert bm.block_table(1) == [0, 1, 3]
    bm.check_integrity()


def test_eviction_takes_the_least_recently_released_cached_block_tail_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    prefill(bm, 1, A + B + [1])  # [0, 1, 2]
    bm.free(1)
    assert bm.device.free_order() == [3, 2, 1, 0]
    bm.allocate(2, 12)  # plain free blocks first, then evicts B's block 1
    assert bm.block_table(2) == [3, 2, 1]
    assert bm.device.num_cached == 1 and bm.device.free_order() == [0]
    assert bm.prefix_hit(3, A + B + [1]) == [0]  # B's hash was forgotten, A survives
    bm.allocate(4, 1)
    assert bm.block_table(4) == [0]
    assert bm.prefix_hit(5, A + B + [1]) == []
    bm.check_integrity()


def test_a_revived_block_is_released_as_most_recent() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    prefill(bm, 1, A + [1])  # [0, 1]
    prefill(bm, 2, B + [1])  # [2, 3]
    bm.free(1)
    bm.free(2)
    assert bm.device.free_order() == [1, 3, 0, 2]
    admit(bm, 3, A + [2])  # revives 0, takes 1
    bm.free(3)
    assert bm.device.free_order() == [3, 1, 2, 0]
    bm.check_integrity()


def test_prefix_caching_off_never_hits() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    prefill(bm, 1, A + B + [1])
    assert bm.prefix_hit(2, A + B + [1]) == []
    bm.free(1)
    assert bm.device.num_cached == 0
    assert bm.device.free_order() == [3, 4, 5, 6, 7, 2, 1, 0]
    assert bm.prefix_hit(3, A + B + [1]) == []
    bm.check_integrity()


# ---------------------------------------------------------------- block_tables mirror


def test_block_tables_are_ragged_rows_in_the_order_asked() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate(1, 12)
    bm.allocate(2, 1)
    tables = bm.block_tables([2, 1])
    assert tables.ids.dtype == np.int32 and tables.offsets.dtype == np.int32
    assert tables.offsets.tolist() == [0, 1, 4] and tables.ids.tolist() == [3, 0, 1, 2]
    empty = bm.block_tables([])
    assert empty.offsets.tolist() == [0] and empty.ids.size == 0


def test_block_tables_never_leak_stale_ids_after_free_and_reuse() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate(1, 12)  # [0, 1, 2]
    bm.allocate(3, 12)  # [3, 4, 5]
    bm.free(1)
    bm.allocate(2, 4)
    assert bm.block_table(2) == [6]
    for _ in range(2):  # a gather leaves the mirror as it was
        assert bm.block_tables([2, 3]).dense().tolist() == [[6, -1, -1], [3, 4, 5]]
    bm.check_integrity()


def test_one_long_table_costs_only_its_own_entries() -> None:
    """A 65,536-block sequence beside 255 one-block ones: the plan's tables and the mirror
    hold about the blocks referenced, not 256 rows of the longest table's width."""
    bm = BlockManager(num_blocks=70_000, block_size=16)
    for seq_id in range(255):
        bm.allocate(seq_id, 1)
    for end in range(16 * 4096, 16 * 65_536 + 1, 16 * 4096):  # a long prompt, chunk by chunk
        bm.allocate(1000, end)
    tables = bm.block_tables([*range(255), 1000])
    assert tables.ids.size == 255 + 65_536 and tables.row(255).tolist() == bm.block_table(1000)
    assert bm.mirror.arena_size <= 4 * (255 * 4 + 65_536)
    bm.check_integrity()


def test_the_mirror_follows_growth_moves_and_compaction() -> None:
    bm = BlockManager(num_blocks=3000, block_size=1)
    for seq_id in range(100):
        bm.allocate(seq_id, 1)
    epoch = bm.rows_epoch
    bm.allocate(0, 130)  # outgrows its segment: it moves, and the epoch says so
    assert bm.rows_epoch != epoch
    for seq_id in range(1, 100, 2):
        bm.free(seq_id)
    for seq_id in range(100, 300):  # enough churn to compact the holes away
        bm.allocate(seq_id, 3)
        bm.free(seq_id - 1 if seq_id % 2 else seq_id)
    live = sorted(bm.tables)
    tables = bm.block_tables(live)
    assert [tables.row(i).tolist() for i in range(len(live))] == [bm.block_table(s) for s in live]
    assert tables.row(live.index(0)).size == 130
    bm.check_integrity()


# ---------------------------------------------------------------- integrity


def test_integrity_check_catches_a_double_owner() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate(1, 4)
    bm._tables[2] = list(bm.block_table(1))  # corrupt on purpose
    with pytest.raises(AssertionError):
        bm.check_integrity()


def test_integrity_check_catches_a_wrong_ref_count() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate(1, 4)
    bm.device.ref[0] += 1  # corrupt on purpose
    with pytest.raises(AssertionError, match="block 0 has ref 2, tables hold 1"):
        bm.check_integrity()


# ---------------------------------------------------------------- property test


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admissions, steps, forks, frees, recomputes and swaps against a content shadow.

    The shadow holds what each physical block would contain if the worker executed every
    take_ops() pair (swap out, swap in, copy: its order) and wrote each step's tokens into
    the slots the tables name. Tokens come from a two-letter alphabet so prefix hits happen.
    """

    BS = 2

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(num_blocks=12, block_size=self.BS, num_host_blocks=6)
        self.gpu_kv: dict[int, list[int | None]] = {}
        self.cpu_kv: dict[int, list[int | None]] = {}
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.allocated: dict[int, int] = {}  # tokens the table was sized for
        self.where: dict[int, str] = {}  # "device" | "host" | "dropped"
        self.family: dict[int, int] = {}  # forks share the root's id
        self.next_id = 0

    # ---- helpers ----

    def _pick(self, index: int, where: str) -> int | None:
        ids = sorted(s for s, w in self.where.items() if w == where)
        return ids[index % len(ids)] if ids else None

    def _sync(self, copies: int = 0, swap_out: int = 0, swap_in: int = 0) -> None:
        """Drain take_ops and apply it to the shadow, as the worker would."""
        out, into, copy = self.bm.take_ops()
        assert (len(out), len(into), len(copy)) == (swap_out, swap_in, copies)
        for src, dst in out.tolist():
            self.cpu_kv[dst] = list(self.gpu_kv.get(src, [None] * self.BS))
        for src, dst in into.tolist():
            self.gpu_kv[dst] = list(self.cpu_kv.get(src, [None] * self.BS))
        for src, dst in copy.tolist():
            self.gpu_kv[dst] = list(self.gpu_kv.get(src, [None] * self.BS))

    def _allocate(self, seq_id: int, num_tokens: int, write_from: int) -> None:
        bm = self.bm
        table = bm.block_table(seq_id)
        growth = max(0, bm.blocks_for(num_tokens) - len(table))
        copies = bm.blocks_needed(seq_id, num_tokens, write_from) - growth
        bm.allocate(seq_id, num_tokens, write_from)
        self.allocated[seq_id] = max(self.allocated.get(seq_id, 0), num_tokens)
        self._sync(copies=copies)
        # Copy-on-write: nobody else references a block this sequence is about to write.
        table = bm.block_table(seq_id)
        for i in range(write_from // self.BS, bm.blocks_for(num_tokens)):
            assert bm.device.ref[table[i]] == 1, (seq_id, i, table)

    def _admit(self, seq_id: int) -> bool:
        bm, tokens = self.bm, self.tokens[seq_id]
        hit = bm.prefix_hit(seq_id, tokens)
        assert len(hit) * self.BS < len(tokens)  # a token is always left to compute
        cost = bm.admission_cost(hit, len(tokens))
        if cost > bm.num_free_blocks:
            return False
        free_before = bm.num_free_blocks
        bm.attach(seq_id, hit)
        self._allocate(seq_id, len(tokens), len(hit) * self.BS)
        assert free_before - bm.num_free_blocks == cost
        assert bm.block_table(seq_id)[: len(hit)] == hit
        self.computed[seq_id] = len(hit) * self.BS
        self.where[seq_id] = "device"
        return True

    # ---- rules ----

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=8))
    def new_sequence(self, tokens: list[int]) -> None:
        seq_id = self.next_id
        self.next_id += 1
        self.tokens[seq_id] = tokens
        self.family[seq_id] = seq_id
        if not self._admit(seq_id):
            self.bm.free(seq_id)  # rejected: forget the hashes prefix_hit computed
            del self.tokens[seq_id], self.family[seq_id]

    @precondition(lambda self: "device" in self.where.values())
    @rule(index=st.integers(0, 99), q=st.integers(1, 3))
    def compute(self, index: int, q: int) -> None:
        """Feed up to q uncomputed tokens (the one rule for prefill chunks and decode)."""
        seq_id = self._pick(index, "device")
        assert seq_id is not None
        done, tokens = self.computed[seq_id], self.tokens[seq_id]
        q = min(q, len(tokens) - done)
        if q == 0 or not self.bm.can_allocate(seq_id, done + q, write_from=done):
            return
        self._allocate(seq_id, done + q, done)
        table = self.bm.block_table(seq_id)
        for t in range(done, done + q):
            block = table[t // self.BS]
            assert self.bm.device._hash_of[block] is None  # never write into an indexed block
            self.gpu_kv.setdefault(block, [None] * self.BS)[t % self.BS] = tokens[t]
        self.computed[seq_id] = done + q
        self.bm.commit(seq_id, tokens, done + q)

    @precondition(lambda self: "device" in self.where.values())
    @rule(index=st.integers(0, 99), token=st.integers(0, 1))
    def sample(self, index: int, token: int) -> None:
        seq_id = self._pick(index, "device")
        assert seq_id is not None
        if self.computed[seq_id] == len(self.tokens[seq_id]) and len(self.tokens[seq_id]) < 14:
            self.tokens[seq_id].append(token)

    @precondition(lambda self: "device" in self.where.values())
    @rule(index=st.integers(0, 99))
    def fork(self, index: int) -> None:
        parent = self._pick(index, "device")
        assert parent is not None
        child = self.next_id
        self.next_id += 1
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.computed[child] = self.computed[parent]
        self.allocated[child] = self.allocated[parent]
        self.where[child] = "device"
        self.family[child] = self.family[parent]

    @precondition(lambda self: bool(self.where))
    @rule(index=st.integers(0, 99))
    def free(self, index: int) -> None:
        seq_id = sorted(self.where)[index % len(self.where)]
        expected = len(self.bm.block_table(seq_id))
        assert self.bm.free(seq_id) == expected
        for d in (self.tokens, self.computed, self.allocated, self.where, self.family):
            d.pop(seq_id, None)

    @precondition(lambda self: "device" in self.where.values())
    @rule(index=st.integers(0, 99))
    def drop_device_blocks(self, index: int) -> None:
        seq_id = self._pick(index, "device")
        assert seq_id is not None
        self.bm.drop_device_blocks(seq_id)
        self.where[seq_id] = "dropped"
        self.computed[seq_id] = 0
        self.allocated[seq_id] = 0

    @precondition(lambda self: "dropped" in self.where.values())
    @rule(index=st.integers(0, 99))
    def readmit(self, index: int) -> None:
        seq_id = self._pick(index, "dropped")
        assert seq_id is not None
        self._admit(seq_id)

    def _sharing(self, tables: list[list[int]]) -> list[list[int]]:
        """Tables with ids renamed by first appearance: equal iff blocks are shared alike."""
        names: dict[int, int] = {}
        return [[names.setdefault(b, len(names)) for b in t] for t in tables]

    @precondition(lambda self: "device" in self.where.values())
    @rule(index=st.integers(0, 99))
    def swap_out(self, index: int) -> None:
        seq_id = self._pick(index, "device")
        assert seq_id is not None
        ids = [s for s, w in sorted(self.where.items()) if w == "device" and self.family[s] == self.family[seq_id]]
        unique = len(self.bm.unique_blocks(ids))
        assert self.bm.can_swap_out(ids) == (unique <= self.bm.host.num_free)
        if not self.bm.can_swap_out(ids):
            return
        before = self._sharing([self.bm.block_table(s) for s in ids])
        assert self.bm.swap_out(ids) == unique
        self._sync(swap_out=unique)
        assert self._sharing([self.bm.host_table(s) for s in ids]) == before
        for s in ids:
            self.where[s] = "host"

    @precondition(lambda self: "host" in self.where.values())
    @rule(index=st.integers(0, 99))
    def swap_in(self, index: int) -> None:
        seq_id = self._pick(index, "host")
        assert seq_id is not None
        ids = [s for s, w in sorted(self.where.items()) if w == "host" and self.family[s] == self.family[seq_id]]
        unique = len(self.bm.unique_blocks(ids, host=True))
        if not self.bm.can_swap_in(ids):
            return
        before = self._sharing([self.bm.host_table(s) for s in ids])
        assert self.bm.swap_in(ids) == unique
        self._sync(swap_in=unique)
        assert self._sharing([self.bm.block_table(s) for s in ids]) == before
        for s in ids:
            self.where[s] = "device"

    # ---- invariants ----

    @invariant()
    def consistent(self) -> None:
        bm = self.bm
        bm.check_integrity()
        for pool in (bm.device, bm.host):
            free = len(pool.free_order()) - pool.num_cached
            used = sum(r > 0 for r in pool.ref)
            assert free + used + pool.num_cached == pool.num_blocks
        device = sorted(s for s, w in self.where.items() if w == "device")
        for seq_id, where in self.where.items():
            table, host = bm.block_table(seq_id), bm.host_table(seq_id)
            n = bm.blocks_for(self.allocated[seq_id])
            expect = {"device": (n, 0), "host": (0, n), "dropped": (0, 0)}[where]
            assert (len(table), len(host)) == expect, (seq_id, where)
            # Every computed token reads back from the sequence's own blocks.
            kv, blocks = (self.gpu_kv, table) if where == "device" else (self.cpu_kv, host)
            for t in range(self.computed[seq_id]):
                assert kv[blocks[t // self.BS]][t % self.BS] == self.tokens[seq_id][t], (seq_id, t)
        if device:
            tables = bm.block_tables(device)
            assert [tables.row(i).tolist() for i in range(len(device))] == [bm.block_table(s) for s in device]
        assert bm.take_ops()[0].shape == (0, 2)  # every rule drained its ops


BlockManagerMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_block_manager_state_machine = BlockManagerMachine.TestCase
