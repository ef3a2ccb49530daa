"""The prefix cache's events as one numbered log, for `SubscribeKvEvents` subscribers.

Each worker group's block manager records its own events (`kv_events.KvEventQueue`); this log
drains them from the event loop while anyone subscribes, and publishes numbered batches:

    groups' queues --drain (every POLL_S)--> merge --> batch #n --> history --> subscribers

A gateway sees this scheduler as one engine, so the groups' caches are merged: a hash is
"stored" when the first group indexes it and "removed" when the last one forgets it (or is
lost). A subscriber that reconnects with the last number it saw gets the batches after it
from the history. One whose number the history cannot serve (this process restarted, or it
fell too far behind) is resynchronised instead: a batch numbered right after its cursor
clears its view of the cache, and live batches follow, renumbered to continue from there.
Numbers start at the process's start time in microseconds, so a cursor handed out by an
earlier process is never mistaken for one of ours.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from scheduler_svc.kv.block_manager import BlockManager
from scheduler_svc.kv.kv_events import BlockRemoved, BlockStored, KvEvent

POLL_S = 0.02
HISTORY_BATCHES = 4096


@dataclass(frozen=True)
class CacheCleared:
    """The subscriber must forget every block it holds for this engine (a resync)."""


@dataclass(frozen=True)
class KvBatch:
    sequence_number: int
    timestamp: float  # seconds since the epoch
    events: tuple[KvEvent | CacheCleared, ...]


class KvEventLog:
    def __init__(self, block_managers: Callable[[], Iterable[BlockManager]]) -> None:
        self._block_managers = block_managers  # those of the serving groups, read at each poll
        self._held: dict[BlockManager, set[int]] = {}  # hashes each group's index holds
        self._count: dict[int, int] = {}  # groups holding each hash
        self._history: deque[KvBatch] = deque(maxlen=HISTORY_BATCHES)
        self._last = time.time_ns() // 1000  # number of the last batch published
        self._new_batch = asyncio.Event()
        self._subscribers = 0
        self._task: asyncio.Task[None] | None = None

    @property
    def last_sequence_number(self) -> int:
        return self._last

    # ---- publishing ----

    def poll(self) -> KvBatch | None:
        """Drain every group's queue into the next batch (None: nothing changed)."""
        current = list(self._block_managers())
        out: list[KvEvent | CacheCleared] = []
        for bm in [b for b in self._held if b not in current]:
            # A lost or replaced group's cache is gone with it, without events of its own.
            for block_hash in self._held.pop(bm):
                self._drop(block_hash, out)
        for bm in current:
            held = self._held.setdefault(bm, set())
            events, lost = bm.kv_events.drain()
            for event in events:
                if isinstance(event, BlockStored):
                    if event.block_hash not in held:
                        held.add(event.block_hash)
                        self._count[event.block_hash] = self._count.get(event.block_hash, 0) + 1
                        if self._count[event.block_hash] == 1:
                            out.append(event)
                elif event.block_hash in held:
                    held.discard(event.block_hash)
                    self._drop(event.block_hash, out)
            if lost:
                # The oldest events fell off the queue: keep only what the index really holds.
                # Blocks indexed meanwhile stay unannounced (their tokens are not known here).
                for block_hash in held - bm.indexed_hashes():
                    held.discard(block_hash)
                    self._drop(block_hash, out)
        if not out:
            return None
        self._last += 1
        batch = KvBatch(self._last, time.time(), tuple(out))
        self._history.append(batch)
        self._new_batch.set()
        self._new_batch = asyncio.Event()
        return batch

    def _drop(self, block_hash: int, out: list[KvEvent | CacheCleared]) -> None:
        left = self._count[block_hash] - 1
        if left:
            self._count[block_hash] = left
        else:
            del self._count[block_hash]
            out.append(BlockRemoved(block_hash))

    async def _run(self) -> None:
        while self._subscribers:
            self.poll()
            await asyncio.sleep(POLL_S)

    # ---- subscribing ----

    @contextmanager
    def subscribe(self, start: int) -> Iterator[AsyncIterator[KvBatch]]:
        """Subscribe from batch number `start` (0: from now on); the subscription is live as
        soon as this returns. Iterate for the batches while inside the `with`.

        The iteration ends when the caller falls more than the history behind; reconnecting
        resyncs it.
        """
        self._subscribers += 1
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="kv-event-log")
        try:
            # Events recorded before this subscription belong to earlier batches, not to its.
            self.poll()
            if not start:
                yield self._follow(self._last, 0, None)
            elif self._can_resume(start):
                yield self._follow(start, 0, None)
            else:
                resync = KvBatch(start + 1, time.time(), (CacheCleared(),))
                yield self._follow(self._last, start + 1 - self._last, resync)
        finally:
            self._subscribers -= 1

    async def _follow(self, cursor: int, offset: int, first: KvBatch | None) -> AsyncIterator[KvBatch]:
        """Batches after `cursor`, numbered `offset` higher, after `first` when given."""
        if first is not None:
            yield first
        while True:
            wake = self._new_batch
            oldest = self._history[0].sequence_number if self._history else self._last + 1
            if cursor + 1 < oldest:
                return  # fell behind the history: the subscriber resyncs when it reconnects
            for batch in list(self._history)[cursor + 1 - oldest :]:
                yield KvBatch(batch.sequence_number + offset, batch.timestamp, batch.events)
                cursor = batch.sequence_number
            if cursor == self._last:
                await wake.wait()

    def _can_resume(self, start: int) -> bool:
        """Whether every batch after `start` is still in the history (or none was published)."""
        if start == self._last:
            return True
        return bool(self._history) and self._history[0].sequence_number <= start + 1 <= self._last
