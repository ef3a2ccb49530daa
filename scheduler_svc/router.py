"""Which worker group a request goes to: the one with the most room left after taking it.

    room = free device blocks - blocks the group's queued requests will take
           + blocks of this prompt its prefix cache already holds

A prefix-cache hit counts as room because those blocks need not be computed or allocated
again, so a request follows its prefix (a shared system prompt, a conversation's earlier
turns) while that group is no busier than the others by more than the hit is worth; past
that, load wins and the prefix is computed again elsewhere. Queued demand counts so that a
burst of requests arriving between two steps spreads across groups instead of piling onto
whichever looked emptiest before the burst. Ties go to the group running fewer requests.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler_svc.block_manager import extend_chain
from scheduler_svc.replica import Replica


class Router:
    def __init__(self, enable_prefix_caching: bool) -> None:
        self.enable_prefix_caching = enable_prefix_caching

    def pick(self, candidates: list[Replica], token_ids: Sequence[int]) -> Replica | None:
        """The best of `candidates` (each ready, and able to take the request) for these tokens."""
        if len(candidates) <= 1:
            return candidates[0] if candidates else None
        hashes: list[int] = []
        if self.enable_prefix_caching:
            block_size = candidates[0].scheduler.block_manager.block_size  # type: ignore[union-attr]
            # As in BlockManager.prefix_hit: the last prompt token is always computed.
            extend_chain(hashes, token_ids, block_size, (len(token_ids) - 1) // block_size)
        return max(candidates, key=lambda r: self._room(r, hashes))

    @staticmethod
    def _room(replica: Replica, hashes: list[int]) -> tuple[int, int]:
        sched = replica.scheduler
        assert sched is not None
        hit = sched.block_manager.cached_prefix_blocks(hashes) if hashes else 0
        return (replica.free_capacity() + hit, -sched.num_running)
