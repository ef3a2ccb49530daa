"""One worker group (data-parallel replica) and the scheduler that keeps its KV accounting.

Each replica has its own block manager, queues and engine-loop task: worker groups do not
share KV memory, so their blocks are accounted apart. The engine routes a new request to one
replica (`router.Router`) and posts it to that replica's inbox; only the replica's own loop
task touches its scheduler. When the worker group is lost, `evacuate` hands back every
unfinished request, with its tokens, for another replica to compute again.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from common.worker_info import WorkerInfo
from scheduler_svc.engine.engine_stats import EngineStats
from scheduler_svc.engine.group_speed import GroupSpeed
from scheduler_svc.engine.load import GroupActivity, GroupLoad
from scheduler_svc.engine.request_stream import RequestStream
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.sequence_group import SequenceGroup
from scheduler_svc.workers.worker_client import WorkerLink


@dataclass(eq=False)
class CacheFlush:
    """Forget the group's cached prefix blocks at its next step boundary, if none is in use.

    `done` receives the number of blocks forgotten, or None when blocks were in use (or the
    group went away first).
    """

    done: asyncio.Future[int | None]

    def resolve(self, result: int | None) -> None:
        if not self.done.done():
            self.done.set_result(result)


# Inbox items: a group to add, the stream of a request to abort, or a cache flush.
Inbox = list["SequenceGroup | RequestStream | CacheFlush"]


@dataclass(eq=False)
class Replica:
    name: str  # the registered group name, or the --worker address
    worker: WorkerLink
    # False once a registered group deregistered (or was refused): its task ends.
    attached: bool = True
    scheduler: Scheduler | None = None  # set while the worker group is connected and serving
    info: WorkerInfo | None = None
    inbox: Inbox = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    stats: EngineStats = field(default_factory=EngineStats)
    speed: GroupSpeed = field(default_factory=GroupSpeed)  # what the router weighs unequal groups by
    # Scheduler counters already published to Prometheus: (preemptions, prefix queries, hits,
    # steps planned ahead, adapter slot loads).
    reported: tuple[int, ...] = (0, 0, 0, 0, 0)
    reported_drafts: tuple[int, int] = (0, 0)  # speculative decoding: (drafted, accepted) published

    @property
    def ready(self) -> bool:
        return self.scheduler is not None and self.attached

    @property
    def serving_scheduler(self) -> Scheduler:
        """The scheduler of a ready group (the router and fleet only look at ready ones)."""
        if self.scheduler is None:
            raise RuntimeError(f"worker group {self.name} is not serving")
        return self.scheduler

    @property
    def block_bytes(self) -> int:
        return self.info.block_bytes if self.info is not None else 0

    def post(self, item: SequenceGroup | RequestStream | CacheFlush) -> None:
        self.inbox.append(item)
        self.wake.set()

    @property
    def num_queued(self) -> int:
        """Requests waiting for admission here, those still in the inbox included."""
        waiting = self.scheduler.num_waiting if self.scheduler is not None else 0
        return waiting + sum(isinstance(i, SequenceGroup) for i in self.inbox)

    def free_capacity(self) -> int:
        """Free device blocks minus what the queued requests' tokens will take when admitted."""
        sched = self.scheduler
        if sched is None:
            return 0
        bm = sched.block_manager
        queued = [g for g in self.inbox if isinstance(g, SequenceGroup)] + sched.queues.waiting
        demand = sum(bm.blocks_for(g.seqs[0].num_tokens) for g in queued)
        return bm.num_free_blocks - demand

    def evacuate(self) -> tuple[list[SequenceGroup], list[RequestStream]]:
        """Everything this replica held: unfinished groups (in line order) and pending aborts."""
        groups: list[SequenceGroup] = []
        if self.scheduler is not None:
            groups = self.scheduler.evacuate()
        self.scheduler = None
        inbox, self.inbox = self.inbox, []
        posted = [i for i in inbox if isinstance(i, SequenceGroup)]
        aborts = [i for i in inbox if isinstance(i, RequestStream)]
        for item in inbox:
            if isinstance(item, CacheFlush):
                item.resolve(None)  # the cache goes with the group
        return sorted(groups + posted, key=lambda g: g.key), aborts

    def activity(self, max_running: int) -> GroupActivity | None:
        sched, load = self.scheduler, self.load()
        if sched is None or load is None:
            return None
        return GroupActivity(
            load=load,
            block_size=sched.block_manager.block_size,
            max_running=max_running,
            prefix_queried_tokens=sched.queues.prefix_queried_tokens,
            prefix_hit_tokens=sched.queues.prefix_hit_tokens,
            output_tokens_per_s=self.stats.output_rate(),
            waiting_uncached_tokens=self._waiting_uncached_tokens(sched),
        )

    def _waiting_uncached_tokens(self, sched: Scheduler) -> int:
        """Prompt tokens the queued requests will compute here: their prefix-cache hits excluded."""
        bm = sched.block_manager
        total = 0
        for group in [g for g in self.inbox if isinstance(g, SequenceGroup)] + sched.queues.waiting:
            tokens = group.seqs[0].token_ids
            total += len(tokens) - bm.cached_prefix_blocks(bm.prompt_chain(tokens, group.cache_salt)) * bm.block_size
        return total

    def load(self) -> GroupLoad | None:
        sched = self.scheduler
        if sched is None:
            return None
        bm = sched.block_manager
        return GroupLoad(
            name=self.name,
            address=self.worker.address,
            num_gpu_blocks=bm.num_blocks,
            free_gpu_blocks=bm.num_free_blocks,
            num_cpu_blocks=bm.host.num_blocks,
            free_cpu_blocks=bm.host.num_free,
            running=sched.num_running,
            waiting=self.num_queued,
            swapped=sched.num_swapped,
            tokens_per_second=round(self.speed.tokens_per_second, 1),
        )
