"""What the prefix cache indexed and forgot, recorded as it happens, for gateways to follow.

A gateway that routes by cache affinity (smg's `SubscribeKvEvents`) mirrors each engine's
prefix cache from these events. The block manager records them inside the scheduler's
synchronous step, so recording is an append to a bounded deque and nothing more: no I/O, no
clock, no subscriber bookkeeping. Whoever publishes them (`kv_event_log.KvEventLog`) drains
the deque from the event loop between steps.

    commit() indexes a full block  ->  BlockStored(hash, parent hash, its tokens)
    take() evicts a cached block   ->  BlockRemoved(hash)
    reset_prefix_cache()           ->  BlockRemoved(hash) for each forgotten block

When nobody drains for long, the oldest events fall off the deque; `drain` then says events
were lost, and the publisher resynchronises from the index itself (`BlockManager.indexed_hashes`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

# A 2,048-token step fills at most 128 blocks: this is many steps' worth between two polls,
# and a few MB at most when nobody drains.
DEFAULT_MAX_EVENTS = 4096


@dataclass(frozen=True)
class BlockStored:
    """A full block became reusable: its chain hash, its parent's (None: first block), its tokens."""

    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class BlockRemoved:
    """An indexed block left the prefix cache (evicted for reuse, or flushed)."""

    block_hash: int


KvEvent = BlockStored | BlockRemoved


class KvEventQueue:
    def __init__(self, max_events: int = DEFAULT_MAX_EVENTS) -> None:
        if max_events <= 0:
            raise ValueError(f"max_events must be positive, got {max_events}")
        self._events: deque[KvEvent] = deque(maxlen=max_events)
        self._lost = False

    def __len__(self) -> int:
        return len(self._events)

    def stored(self, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]) -> None:
        self._append(BlockStored(block_hash, parent_hash, token_ids))

    def removed(self, block_hash: int) -> None:
        self._append(BlockRemoved(block_hash))

    def _append(self, event: KvEvent) -> None:
        if len(self._events) == self._events.maxlen:
            self._lost = True  # the deque drops its oldest event to take this one
        self._events.append(event)

    def drain(self) -> tuple[list[KvEvent], bool]:
        """The events since the last drain, oldest first, and whether older ones were lost."""
        events, lost = list(self._events), self._lost
        self._events.clear()
        self._lost = False
        return events, lost
