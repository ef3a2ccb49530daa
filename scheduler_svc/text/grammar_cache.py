"""Compiled grammars kept for reuse, named by a hash of what they compile, within a byte budget.

A compiled grammar holds its token-mask cache: about 1.4 MB for a small JSON schema over a
49k vocabulary, 2.4 MB for a string of up to 100,000 characters (xgrammar's
`memory_size_bytes`). Counting entries would let a client sending a new schema per request
hold hundreds of megabytes; counting bytes holds the cache to what the operator gave it
(--grammar-cache-mb). Keys are hashes, so the cache keeps no copy of the schemas' text.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any


class GrammarCache:
    """Least recently used first out; safe to use from several threads."""

    def __init__(self) -> None:
        self._entries: OrderedDict[bytes, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.size_bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> Any | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: bytes, compiled: Any, size: int, budget: int) -> None:
        """Keep `compiled` (`size` bytes), forgetting the least recently used until all fit in
        `budget` bytes; one bigger than the whole budget is not kept."""
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.size_bytes -= old[1]
            if size > budget:
                return
            self._entries[key] = (compiled, size)
            self.size_bytes += size
            while self.size_bytes > budget:
                _, (_, freed) = self._entries.popitem(last=False)
                self.size_bytes -= freed

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.size_bytes = 0
