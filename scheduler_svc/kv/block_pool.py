"""A pool of physical KV block ids with reference counts, and the prefix cache's index.

Every block is in exactly one of three places:

    free    ref 0, no content worth keeping            FIFO: taken from the left
    cached  ref 0, holds a full block whose content      LRU: evicted from the left
            hash is indexed (prefix caching)
    used    ref >= 1 (shared by forks and prefix hits)

`take()` prefers never-hashed free blocks and evicts the least recently released cached block
only when none is left, so a prefix stays reusable for as long as memory allows. The host
swap pool is the same structure with caching off.

Every block that leaves the index is reported to `events` (when given), so a gateway can
mirror the cache; the pool cannot report what it indexes, since it never sees tokens
(`BlockManager.commit` does).
"""

from __future__ import annotations

from collections import OrderedDict, deque

from scheduler_svc.kv.kv_events import KvEventQueue


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool, events: KvEventQueue | None = None) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must not be negative, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.events = events
        self.ref = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._by_hash: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks `take()` can hand out: free plus evictable cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def free_order(self) -> list[int]:
        """The ids `take()` would return next, in order (tests assert it)."""
        return list(self._free) + list(self._cached)

    def take(self) -> int:
        """A block with ref 1 and no hash."""
        if self._free:
            block = self._free.popleft()
        elif self._cached:
            block, _ = self._cached.popitem(last=False)
            self._unindex(block)
        else:
            raise RuntimeError("block pool exhausted")
        self.ref[block] = 1
        return block

    def incref(self, block: int) -> None:
        if self.ref[block] == 0:
            # Only a cached block is revived; a plain free block is never referenced by id.
            del self._cached[block]
        self.ref[block] += 1

    def decref(self, block: int) -> None:
        ref = self.ref[block] - 1
        if ref < 0:
            raise RuntimeError(f"block {block} released more often than taken")
        self.ref[block] = ref
        if ref == 0:
            if self._hash_of[block] is not None:
                self._cached[block] = None
            else:
                self._free.append(block)

    # ---- prefix cache index ----

    def lookup(self, content_hash: int) -> int | None:
        return self._by_hash.get(content_hash)

    def is_cached(self, block: int) -> bool:
        """Whether the block is referenced by nobody and would be revived by a hit."""
        return self.ref[block] == 0

    def register(self, block: int, content_hash: int) -> bool:
        """Index a used, full block by its content; a hash already indexed keeps its block.

        Returns whether the block was indexed (False: caching off, or nothing new)."""
        if not self.enable_caching or content_hash in self._by_hash or self._hash_of[block] is not None:
            return False
        self._by_hash[content_hash] = block
        self._hash_of[block] = content_hash
        return True

    def _unindex(self, block: int) -> None:
        content_hash = self._hash_of[block]
        if content_hash is not None:
            del self._by_hash[content_hash]
            self._hash_of[block] = None
            if self.events is not None:
                self.events.removed(content_hash)

    def indexed_hashes(self) -> set[int]:
        """Every content hash the index holds (cached blocks and used ones)."""
        return set(self._by_hash)

    def reset_cache(self) -> int:
        """Forget every cached block (they become plain free blocks); returns how many."""
        n = len(self._cached)
        while self._cached:
            block, _ = self._cached.popitem(last=False)
            self._unindex(block)
            self._free.append(block)
        return n

    def check_integrity(self, expected_refs: dict[int, int]) -> None:
        """free + used + cached = total; ref counts equal the references the tables hold."""
        free, cached = set(self._free), set(self._cached)
        used = {b for b, r in enumerate(self.ref) if r > 0}
        if len(free) != len(self._free):
            raise AssertionError("a block appears twice in the free queue")
        if free & cached or free & used or cached & used:
            raise AssertionError("a block is in two of free, cached and used")
        if len(free) + len(cached) + len(used) != self.num_blocks:
            raise AssertionError(
                f"free {len(free)} + cached {len(cached)} + used {len(used)} != total {self.num_blocks}"
            )
        for block in range(self.num_blocks):
            if self.ref[block] != expected_refs.get(block, 0):
                raise AssertionError(
                    f"block {block} has ref {self.ref[block]}, tables hold {expected_refs.get(block, 0)}"
                )
        for content_hash, block in self._by_hash.items():
            if self._hash_of[block] != content_hash:
                raise AssertionError(f"hash index and block {block} disagree")
        if any(self._hash_of[b] is not None for b in free):
            # take() hands free blocks out without unindexing them: a hit would read reused KV.
            raise AssertionError("a free block still carries a hash")
        if not cached <= set(self._by_hash.values()):
            raise AssertionError("a cached block is not indexed")
        if sum(h is not None for h in self._hash_of) != len(self._by_hash):
            raise AssertionError("a block carries a hash the index lacks")
