"""The three queues (waiting, running, swapped) and the verbs that move a group between them.

Every queue is ordered by the group's place in line, (priority, arrival), which no verb
changes. Beside the queues this object keeps what must change with them in the same breath:
the group and sequence indexes, the sequence slots the running groups hold (against
`max_num_seqs`), their LoRA slots, and the preemption and prefix-cache counters. The planner
(`step_planner.py`) decides which verbs a step calls and the Scheduler calls the others;
neither touches the lists, so `check_integrity` holds between any two verbs.

    add ──► waiting ──resume──► running ──preempt(swap)──► swapped ──resume──► running
                ▲                  │
                └─preempt(recompute)┘          end / abort: from any queue, blocks freed

A sequence names its group by id (`Sequence.group_id`); `group_of` maps it back.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator

from scheduler_svc.kv.block_manager import BlockManager
from scheduler_svc.lora.adapter_slots import AdapterSlots
from scheduler_svc.sched.preemption import PreemptionMode, PreemptionPolicy
from scheduler_svc.sched.sequence import FinishReason, Sequence, SequenceStatus
from scheduler_svc.sched.sequence_group import SequenceGroup


class Queues:
    def __init__(
        self,
        block_manager: BlockManager,
        policy: PreemptionPolicy,
        adapter_slots: AdapterSlots,
        seq_ids: Iterator[int] | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.policy = policy
        # The worker group's LoRA slots (none: adapters off): a running group holds its adapter's.
        self.adapter_slots = adapter_slots
        self.waiting: list[SequenceGroup] = []
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self.groups: dict[int, SequenceGroup] = {}  # by group_id
        self.seqs: dict[int, Sequence] = {}  # the live sequences of the indexed groups
        # Shared by every scheduler of an engine, so a group can move to another worker group's
        # scheduler (recovery) without its sequence ids colliding there.
        self._ids: Iterator[int] = seq_ids if seq_ids is not None else itertools.count()
        # Sequence slots held by running groups (a group holds its widest count: best_of or beam width).
        self.running_slots = 0
        # Groups resumed from waiting since the last `admitted.clear()` (the engine times their queueing).
        self.admitted: list[SequenceGroup] = []
        self.last_preempt_step = -1
        # Counters for metrics.
        self.num_preemptions = 0
        self.num_swap_preemptions = 0
        self.num_recompute_preemptions = 0
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    def new_seq_id(self) -> int:
        return next(self._ids)

    def group_of(self, seq: Sequence) -> SequenceGroup:
        """The indexed group of a live sequence."""
        return self.groups[seq.group_id]

    def head(self) -> SequenceGroup | None:
        """The next group in line to resume or admit."""
        w = self.waiting[0] if self.waiting else None
        s = self.swapped[0] if self.swapped else None
        if w is None or (s is not None and s.key < w.key):
            return s
        return w

    def add(self, group: SequenceGroup) -> None:
        """Index a group whose live sequences are ready to run and queue it as waiting."""
        if group.group_id in self.groups:
            raise ValueError(f"group {group.group_id} is already scheduled")
        group.status = SequenceStatus.WAITING
        for seq in group.live():
            seq.status = SequenceStatus.WAITING
            self.seqs[seq.seq_id] = seq
        self.groups[group.group_id] = group
        self._enqueue(self.waiting, group)

    def _enqueue(self, queue: list[SequenceGroup], group: SequenceGroup) -> None:
        bisect.insort(queue, group, key=lambda g: g.key)

    def end_seq(self, seq: Sequence, reason: FinishReason) -> None:
        self.block_manager.free(seq.seq_id)
        seq.pending = 0
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self.seqs[seq.seq_id]

    def end_group(self, group: SequenceGroup) -> None:
        if group.status is SequenceStatus.RUNNING:
            self.running_slots -= group.width
            if group.adapter is not None:
                self.adapter_slots.release(group.adapter)
        for queue in (self.running, self.waiting, self.swapped):
            if group in queue:
                queue.remove(group)
        group.status = SequenceStatus.FINISHED
        self.groups.pop(group.group_id, None)

    def finish_seq(self, seq_id: int, reason: FinishReason) -> bool:
        """End one sequence (e.g. on a stop string); returns whether its group ended too."""
        seq = self.seqs.get(seq_id)
        if seq is None or seq.is_finished:
            return False
        group = self.group_of(seq)
        self.end_seq(seq, reason)
        if not group.live():
            self.end_group(group)
            return True
        return False

    def abort(self, group_id: int) -> SequenceGroup | None:
        """End a group wherever it is and free its blocks; unknown ids are ignored."""
        group = self.groups.get(group_id)
        if group is None:
            return None
        for seq in group.live():
            self.end_seq(seq, FinishReason.ABORTED)
        self.end_group(group)
        return group

    def take_all(self) -> list[SequenceGroup]:
        """Every indexed group, in line order, with its blocks freed and nothing computed: the
        queues are left empty (a lost worker group's groups, to be computed again elsewhere)."""
        groups = sorted(self.groups.values(), key=lambda g: g.key)
        for group in groups:
            for seq in group.live():
                self.block_manager.free(seq.seq_id)
                del self.seqs[seq.seq_id]
                seq.num_computed_tokens = 0
                seq.status = SequenceStatus.WAITING
            group.status = SequenceStatus.WAITING
            # Step ids are this scheduler's own; the anti-thrash rule must not carry over.
            group.preempted_step = -1
        self.waiting.clear()
        self.running.clear()
        self.swapped.clear()
        self.groups.clear()
        self.running_slots = 0
        self.adapter_slots.reset()
        return groups

    def preempt(self, group: SequenceGroup, step_id: int) -> PreemptionMode:
        """Give back the group's device blocks, by swap or recompute, in step `step_id`; it
        keeps its place in line."""
        bm = self.block_manager
        live = group.live()
        if any(seq.pending for seq in live):
            # Planning ahead never preempts (Scheduler._plan_ahead); the token in flight would be lost.
            raise RuntimeError(f"group {group.request_id} preempted with a token in flight")
        ids = [s.seq_id for s in live]
        num_blocks = len(bm.unique_blocks(ids))
        computed = sum(s.num_computed_tokens for s in live)
        mode = self.policy.choose(num_blocks, computed, bm.host.num_free)
        self.running.remove(group)
        self.running_slots -= group.width
        if group.adapter is not None:
            self.adapter_slots.release(group.adapter)
        if mode is PreemptionMode.SWAP:
            group.swapped_blocks += bm.swap_out(ids)
            group.num_swaps += 1
            group.status = SequenceStatus.SWAPPED
            self._enqueue(self.swapped, group)
            self.num_swap_preemptions += 1
        else:
            for seq in live:
                bm.drop_device_blocks(seq.seq_id)
                seq.num_computed_tokens = 0
            group.status = SequenceStatus.WAITING
            self._enqueue(self.waiting, group)
            self.num_recompute_preemptions += 1
        for seq in live:
            seq.status = group.status
            seq.num_preemptions += 1
        group.num_preemptions += 1
        group.preempted_step = self.last_preempt_step = step_id
        self.num_preemptions += 1
        return mode

    def resume(self, group: SequenceGroup) -> None:
        """Move the head of swapped or waiting (`head`) to running: swapped blocks come back
        in, a new prompt starts from its prefix-cache hit."""
        if group.status is SequenceStatus.SWAPPED:
            if not self.swapped or self.swapped[0] is not group:
                raise RuntimeError(f"group {group.request_id} is not the head of the swapped queue")
            self.swapped.pop(0)
            group.swapped_blocks += self.block_manager.swap_in([s.seq_id for s in group.live()])
        else:
            if not self.waiting or self.waiting[0] is not group:
                raise RuntimeError(f"group {group.request_id} is not the head of the waiting queue")
            self.waiting.pop(0)
            self._attach_prefixes(group)
            self.admitted.append(group)
        group.status = SequenceStatus.RUNNING
        for seq in group.live():
            seq.status = SequenceStatus.RUNNING
        self._enqueue(self.running, group)
        self.running_slots += group.width
        if group.adapter is not None:
            self.adapter_slots.acquire(group.adapter)

    def _attach_prefixes(self, group: SequenceGroup) -> None:
        """Start the group's first sequence from its prefix-cache hit (the others follow it)."""
        bm = self.block_manager
        for seq in group.live()[:1]:
            # Prompt log-probabilities need every prompt position computed: no prefix reuse.
            hit = (
                []
                if seq.sampling.prompt_logprobs is not None
                else bm.prefix_hit(seq.seq_id, seq.token_ids, group.cache_salt)
            )
            bm.attach(seq.seq_id, hit)
            seq.num_computed_tokens = len(hit) * bm.block_size
            group.prefix_hit_tokens += seq.num_computed_tokens
            if seq.sampling.prompt_logprobs is None:  # the others never query the cache
                self.prefix_hit_tokens += seq.num_computed_tokens
                self.prefix_queried_tokens += seq.num_tokens

    def fork(self, parent: Sequence, index: int, seed: int) -> Sequence:
        """A new sequence of the parent's group sharing all its blocks."""
        child = parent.fork(self.new_seq_id(), index, seed)
        self.block_manager.fork(parent.seq_id, child.seq_id)
        self.group_of(parent).seqs.append(child)
        self.seqs[child.seq_id] = child
        return child

    def check_integrity(self) -> None:
        """Queues, sequence states and block tables agree with each other and with the pools."""
        bm = self.block_manager
        bm.check_integrity()
        queued = self.waiting + self.running + self.swapped
        if {g.group_id for g in queued} != set(self.groups) or len(queued) != len(self.groups):
            raise AssertionError("queues and the group index disagree")
        for queue in (self.waiting, self.running, self.swapped):
            if [g.key for g in queue] != sorted(g.key for g in queue):
                raise AssertionError("a queue is out of line order")
        for group in queued:
            for seq in group.live():
                if seq.status is not group.status:
                    raise AssertionError(f"seq {seq.seq_id} is {seq.status}, its group {group.status}")
                if seq.group_id != group.group_id:
                    raise AssertionError(f"seq {seq.seq_id} names group {seq.group_id}, not {group.group_id}")
                table, host = bm.block_table(seq.seq_id), bm.host_table(seq.seq_id)
                if group.status is SequenceStatus.WAITING and (seq.num_computed_tokens or table or host):
                    raise AssertionError(f"waiting seq {seq.seq_id} holds KV state")
                if group.status is SequenceStatus.SWAPPED and (
                    table or len(host) < bm.blocks_for(seq.num_computed_tokens)
                ):
                    raise AssertionError(f"swapped seq {seq.seq_id} has blocks out of place")
                if group.status is SequenceStatus.RUNNING:
                    if host or len(table) < bm.blocks_for(seq.num_computed_tokens):
                        raise AssertionError(
                            f"running seq {seq.seq_id} has {len(table)} blocks for {seq.num_computed_tokens} tokens"
                        )
        if self.running_slots != sum(g.width for g in self.running):
            raise AssertionError(f"running slots counter says {self.running_slots}")
        held: dict[tuple[str, int], int] = {}
        for group in self.running:
            if group.adapter is not None:
                key = (group.adapter.name, group.adapter.version)
                held[key] = held.get(key, 0) + 1
        self.adapter_slots.check_integrity(held)
        if len(self.seqs) != sum(len(g.live()) for g in queued):
            raise AssertionError("sequence index holds finished or unknown sequences")
