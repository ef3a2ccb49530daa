"""BlockPool: free FIFO, the cached LRU of ref-0 hashed blocks, the hash index, integrity."""

from __future__ import annotations

import pytest

from scheduler_svc.kv.block_pool import BlockPool


def test_take_is_fifo_and_a_release_goes_to_the_tail() -> None:
    pool = BlockPool(4, enable_caching=True)
    assert [pool.take(), pool.take()] == [0, 1]
    pool.incref(0)
    pool.decref(0)  # still held once
    assert pool.free_order() == [2, 3]
    pool.decref(0)
    assert pool.free_order() == [2, 3, 0]
    assert (pool.num_free, pool.num_used, pool.num_cached) == (3, 1, 0)
    pool.check_integrity({1: 1})


def test_hashed_blocks_wait_in_the_lru_and_are_evicted_last_and_unindexed() -> None:
    pool = BlockPool(3, enable_caching=True)
    a, b, c = pool.take(), pool.take(), pool.take()
    pool.register(a, 111)
    pool.register(b, 222)
    pool.decref(b)
    pool.decref(a)
    pool.decref(c)
    assert pool.free_order() == [2, 1, 0]  # free FIFO first, then LRU oldest first
    assert pool.num_cached == 2
    assert pool.take() == 2
    assert pool.take() == 1  # evicts the least recently released cached block
    assert pool.lookup(222) is None and pool.lookup(111) == 0
    pool.check_integrity({1: 1, 2: 1})


def test_incref_revives_a_cached_block_and_its_release_is_most_recent() -> None:
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.take(), pool.take()
    pool.register(a, 1)
    pool.register(b, 2)
    pool.decref(a)
    pool.decref(b)
    assert pool.free_order() == [0, 1]
    assert pool.is_cached(0)
    pool.incref(0)
    assert not pool.is_cached(0) and pool.free_order() == [1]
    pool.decref(0)
    assert pool.free_order() == [1, 0]
    pool.check_integrity({})


def test_register_keeps_the_first_block_of_a_hash_and_is_off_without_caching() -> None:
    pool = BlockPool(3, enable_caching=True)
    a, b = pool.take(), pool.take()
    pool.register(a, 7)
    pool.register(b, 7)  # same content: the index keeps block a
    pool.register(a, 8)  # a block is indexed under one hash only
    assert pool.lookup(7) == a and pool.lookup(8) is None
    pool.decref(b)
    assert pool.free_order() == [2, 1]  # b was never indexed: a plain free block
    off = BlockPool(1, enable_caching=False)
    off.register(off.take(), 7)
    assert off.lookup(7) is None


def test_reset_cache_turns_cached_blocks_into_free_ones() -> None:
    pool = BlockPool(2, enable_caching=True)
    a = pool.take()
    pool.register(a, 5)
    pool.decref(a)
    assert pool.reset_cache() == 1
    assert pool.num_cached == 0 and pool.lookup(5) is None
    assert pool.free_order() == [1, 0]
    pool.check_integrity({})


def test_misuse_raises() -> None:
    pool = BlockPool(1, enable_caching=True)
    pool.take()
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.take()
    pool.decref(0)
    with pytest.raises(RuntimeError, match="released more often"):
        pool.decref(0)
    with pytest.raises(ValueError):
        BlockPool(-1, enable_caching=True)


def test_integrity_catches_a_free_block_with_a_hash() -> None:
    pool = BlockPool(2, enable_caching=True)
    a = pool.take()
    pool.register(a, 9)
    pool.ref[a] = 0
    pool._free.append(a)  # corrupt on purpose: released as if it had no hash
    with pytest.raises(AssertionError, match="free block still carries a hash"):
        pool.check_integrity({})
