"""Worker ranks that registered with this scheduler, gathered into groups.

A group is usable once all of its ranks have registered; the engine is handed it then, and
told when any of its ranks leaves (the rank's Register call ended or broke). A rank serving
another model or block size is refused at once, with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import structlog

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Registration:
    address: str
    group: str
    rank: int
    world_size: int
    model_name: str
    block_size: int = 0  # 0: not reported


class WorkerRegistry:
    def __init__(
        self,
        model_name: str,
        on_complete: Callable[[str, list[str]], None],
        on_departure: Callable[[str], None],
        block_size: Callable[[], int] = lambda: 0,
    ) -> None:
        self.model_name = model_name
        # The scheduler's block size: configured, or adopted from the first group (0: not yet).
        self._block_size = block_size
        self._on_complete = on_complete
        self._on_departure = on_departure
        self._groups: dict[str, dict[int, Registration]] = {}

    def join(self, r: Registration) -> str | None:
        """Take a rank; returns why it is refused, or None."""
        if r.model_name != self.model_name:
            return f"this scheduler serves model {self.model_name!r}, the worker serves {r.model_name!r}"
        expected = self._block_size()
        if expected and r.block_size and r.block_size != expected:
            return f"this scheduler uses KV blocks of {expected} tokens, the worker {r.block_size}; start it with --block-size {expected}"
        if not r.address:
            return "the registration has no address to reach the worker at"
        if r.world_size < 1 or not 0 <= r.rank < r.world_size:
            return f"rank {r.rank} is not in a group of {r.world_size}"
        ranks = self._groups.setdefault(r.group, {})
        known = next(iter(ranks.values()), None)
        if known is not None and known.world_size != r.world_size:
            return f"group {r.group!r} has {known.world_size} ranks, this rank says {r.world_size}"
        if r.rank in ranks:
            return f"rank {r.rank} of group {r.group!r} is already registered (at {ranks[r.rank].address})"
        ranks[r.rank] = r
        log.info("rank_registered", group=r.group, rank=r.rank, world_size=r.world_size, address=r.address)
        if len(ranks) == r.world_size:
            self._on_complete(r.group, [ranks[i].address for i in range(r.world_size)])
        return None

    def leave(self, r: Registration) -> None:
        ranks = self._groups.get(r.group, {})
        if ranks.get(r.rank) != r:
            return
        complete = len(ranks) == r.world_size
        del ranks[r.rank]
        if not ranks:
            del self._groups[r.group]
        log.info("rank_departed", group=r.group, rank=r.rank, address=r.address)
        if complete:
            self._on_departure(r.group)
