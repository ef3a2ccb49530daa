"""Which worker group a request goes to: the one with the most room left after taking it.

Only groups that can take it are candidates: the request must fit the group's whole KV cache
(and, for a moved request, its context), and the group's queue must not be full.

    room = free device blocks - blocks the group's queued requests will take
           + blocks of this prompt its prefix cache already holds

A prefix-cache hit counts as room because those blocks need not be computed or allocated
again, so a request follows its prefix (a shared system prompt, a conversation's earlier
turns) while that group is no busier than the others by more than the hit is worth; past
that, load wins and the prefix is computed again elsewhere. Queued demand counts so that a
burst of requests arriving between two steps spreads across groups instead of piling onto
whichever looked emptiest before the burst. Ties go to the group running fewer requests.

Groups of unequal speed (measured: `group_speed.GroupSpeed`, tokens per second of step time)
are weighed by it once the fastest candidate is more than SPEED_SPREAD times the slowest:
then a request goes where its tokens come soonest,

    cost = (requests running + queued there + 1) / tokens per second

so that a group twice as fast takes about twice the requests (a step's time grows with the
tokens in it, so equal cost means loads in the ratio of the speeds), with room (and the
prefix-cache hit in it) breaking ties. Closer than that, the groups count as equal, since the
measurement itself wanders that much between steps, and room decides as above.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.config import SchedulerConfig
from common.errors import InvalidArgument, ResourceExhausted
from scheduler_svc.engine.replica import Replica
from scheduler_svc.sched.sequence_group import SequenceGroup

SPEED_SPREAD = 1.25


class Router:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config

    def place(
        self, ready: list[Replica], token_ids: Sequence[int], total: int, width: int, beam: bool, cache_salt: int = 0
    ) -> Replica:
        """The group a new request goes to, or the error saying why no group can take it.

        `total` is the most tokens each of its `width` sequences may reach; `cache_salt` keys its
        prefix-cache chain (a LoRA adapter's).
        """
        c = self.config
        for name, limit in (("max_num_seqs", c.max_num_seqs), ("max_num_batched_tokens", c.max_num_batched_tokens)):
            if width > limit:
                field = "sampling.beam_width" if beam else "sampling.best_of"
                raise InvalidArgument(
                    field, f"{width} sequences exceed this server's --{name.replace('_', '-')} ({limit})"
                )
        prompt = len(token_ids)
        fit = [r for r in ready if r.serving_scheduler.can_ever_fit(prompt, total, width)]
        if not fit:
            biggest = max((r.serving_scheduler for r in ready), key=lambda s: s.block_manager.num_blocks)
            bm = biggest.block_manager
            raise ResourceExhausted(
                f"the request needs {biggest.blocks_for_group(prompt, total, width)} KV blocks ({width} x up to "
                f"{total} tokens), more than the whole cache holds ({bm.num_blocks} blocks of {bm.block_size}); "
                f"set or lower stopping.max_tokens (unset, it is the rest of the context), the prompt length, n, "
                f"best_of or beam_width; or give the workers a bigger KV pool (--kv-cache-gb, "
                f"--gpu-memory-utilization or --num-gpu-blocks) or a shorter context (--max-model-len)"
            )
        target = self.pick([r for r in fit if r.num_queued < c.max_queue_len], token_ids, cache_salt)
        if target is None:
            raise ResourceExhausted(
                f"the waiting queue is full ({sum(r.num_queued for r in fit)} requests, --max-queue-len "
                f"{c.max_queue_len} per worker group); retry later"
            )
        return target

    def place_moved(self, targets: list[Replica], group: SequenceGroup) -> Replica | None:
        """Where a lost group's request can continue exactly as it would have, if anywhere."""
        return self.pick([r for r in targets if _fits(r, group)], group.seqs[0].token_ids, group.cache_salt)

    def pick(self, candidates: list[Replica], token_ids: Sequence[int], cache_salt: int = 0) -> Replica | None:
        """The best of `candidates` (each ready, and able to take the request) for these tokens."""
        if len(candidates) <= 1:
            return candidates[0] if candidates else None
        # Every group hashes a prompt alike (same block size), so one chain serves them all.
        bm = candidates[0].serving_scheduler.block_manager
        hashes = bm.prompt_chain(token_ids, cache_salt) if self.config.enable_prefix_caching else []
        speeds = [r.speed.tokens_per_second for r in candidates]
        if min(speeds) > 0 and max(speeds) > SPEED_SPREAD * min(speeds):
            return max(candidates, key=lambda r: (-_cost(r), *self._room(r, hashes)))
        return max(candidates, key=lambda r: self._room(r, hashes))

    @staticmethod
    def _room(replica: Replica, hashes: list[int]) -> tuple[int, int]:
        sched = replica.scheduler
        assert sched is not None
        hit = sched.block_manager.cached_prefix_blocks(hashes) if hashes else 0
        return (replica.free_capacity() + hit, -sched.num_running)


def _cost(replica: Replica) -> float:
    sched = replica.scheduler
    assert sched is not None
    return (sched.num_running + replica.num_queued + 1) / replica.speed.tokens_per_second


def _fits(replica: Replica, group: SequenceGroup) -> bool:
    sched = replica.scheduler
    assert sched is not None
    seq, context = group.seqs[0], sched.max_model_len
    total = seq.num_prompt_tokens + seq.stopping.max_tokens if seq.stopping.max_tokens else context
    # Groups may have shorter contexts than the lost one: a request must not be cut short
    # there, nor its tokens so far fed past the end (the worker refuses such a step).
    if total > context or any(s.num_tokens >= context for s in group.live()):
        return False
    return sched.can_ever_fit(seq.num_prompt_tokens, total, group.width)
