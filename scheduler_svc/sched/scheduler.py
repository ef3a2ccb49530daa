"""Continuous batching over three queues: waiting, running, swapped.

Pure and synchronous: `schedule()` returns the next StepPlan, `update(plan, result)` applies
the worker's answer and returns token events. No I/O, no clock, no asyncio; the engine loop
does all of that and is the only caller, so nothing here needs a lock.

The unit is a request's `SequenceGroup`. Every queue is ordered by the group's place in line,
(priority, arrival), which preemption never changes. `StepPlanner` chooses each step's work
(the batching, admission and preemption policy is described there); this class owns the
queues, preempts, and applies results: sampled tokens, stop conditions, beam steps.

Planning ahead: while one plan is in flight, `schedule()` may already return the next one, so
the worker never waits for the scheduler between steps. It assumes the plan in flight is done:
its sequences count its tokens as computed, and each token it samples becomes pending
(`Sequence.pending`), fed to the next step as a deferred input the worker fills in from its
previous step. It does this only when the outcome cannot change the plan: no sequence of the
plan in flight is forked, a beam, penalized (its history would lack the token), scoring its
prompt, or sampling under a structured output (its next mask follows the token); no running
group is about to fork; no block would run short (no preemption); no
higher-priority group waits. Otherwise it
returns None and the engine waits for the result. A sequence that ends on the token in flight
(eos, stop) wastes its row of the step planned ahead; `update` of that step skips it.
LoRA slot loads planned ahead are safe too: a slot is refilled only while no running group
holds it, and the worker applies a plan's loads after the forward pass of the plan before
(plans run in order), so a row of the plan in flight, even of a group aborted since, still
runs through the adapter it was planned with.

Why this cannot thrash or livelock:
  - the victim of a preemption is always the group last in line, so the group first in line
    is never preempted while another runs, and always progresses;
  - a step that had to preempt admits nothing, and a group resumes only with a watermark of
    blocks plus one block per sequence to spare, so it is not evicted by its own next token;
  - priority preemption only displaces strictly lower priority: equal priorities never
    preempt each other, and the displaced group keeps its place in line;
  - admission refuses (RESOURCE_EXHAUSTED) a group that could not fit the pool alone.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from common.config import SchedulerConfig
from common.plan import StepPlan, StepResult
from scheduler_svc.kv.block_manager import BlockManager
from scheduler_svc.lora.adapter_slots import AdapterSlots
from scheduler_svc.sched.beam_search import BeamSearch
from scheduler_svc.sched.plan_builder import PlanBuilder
from scheduler_svc.sched.preemption import PreemptionMode, PreemptionPolicy
from scheduler_svc.sched.sequence import FinishReason, Sequence, SequenceStatus
from scheduler_svc.sched.sequence_group import SequenceGroup
from scheduler_svc.sched.step_planner import StepPlanner


class TokenEvent(NamedTuple):
    """A token appended to `seq` this step; `finish_reason` is set if it ended the sequence.

    Beams report no tokens: their group's end is a single event with token_id -1.
    """

    seq: Sequence
    token_id: int
    logprob: float
    finish_reason: FinishReason | None
    group_finished: bool
    # (token, logprob) of the most likely tokens, when the request asked for logprobs.
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class _InFlight:
    """A plan sent to the worker whose result has not been applied yet."""

    step_id: int
    seqs: list[Sequence]
    plan: StepPlan
    # Set when the next plan was planned ahead of this one's result: its sequences' computed
    # tokens were advanced then, and these rows' sampled tokens made pending.
    advanced: bool = False
    pending_rows: list[int] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        block_bytes: int = 0,
        seq_ids: Iterator[int] | None = None,
        num_lora_slots: int = 0,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.policy = PreemptionPolicy.of(config, block_bytes)
        self.waiting: list[SequenceGroup] = []
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self._groups: dict[int, SequenceGroup] = {}  # by group_id
        self._seqs: dict[int, Sequence] = {}
        # Shared by every scheduler of an engine, so a group can move to another worker group's
        # scheduler (recovery) without its sequence ids colliding there.
        self._ids: Iterator[int] = seq_ids if seq_ids is not None else itertools.count()
        self._next_step_id = 0
        self._in_flight: deque[_InFlight] = deque()  # at most two: one running, one planned ahead
        self._last_preempt_step = -1
        # Groups admitted from waiting by the last schedule() (the engine times their queueing).
        self.admitted: list[SequenceGroup] = []
        # The worker group's LoRA slots (none: adapters off): a running group holds its adapter's.
        self.adapter_slots = AdapterSlots(num_lora_slots)
        self._planner = StepPlanner(self)
        self._builder = PlanBuilder(block_manager, self.adapter_slots)
        # Sequence slots held by running groups (a group holds its widest count: best_of or beam width).
        self.running_slots = 0
        # Counters for metrics.
        self.num_preemptions = 0
        self.num_swap_preemptions = 0
        self.num_recompute_preemptions = 0
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.num_planned_ahead = 0

    # ---- queue changes (called by the engine loop between steps) ----

    @property
    def next_step_id(self) -> int:
        """Id of the step being planned."""
        return self._next_step_id

    @property
    def num_adapter_loads(self) -> int:
        """LoRA adapters put into a slot so far (each is read onto the device once more)."""
        return self.adapter_slots.num_loads

    def new_seq_id(self) -> int:
        return next(self._ids)

    def blocks_for_group(self, num_prompt_tokens: int, max_total_tokens: int, width: int) -> int:
        """Blocks a group needs at its largest: the prompt once, every sequence's own tail.

        The block holding the last prompt token counts as each sequence's own: samples fork
        before that token and each writes it, and a recomputed group (preempted, or moved from
        a lost worker group) shares only the blocks before it (`shared_prompt_blocks`). Counting
        it shared would admit a group its own admission check could never take back.
        """
        bm = self.block_manager
        shared = (num_prompt_tokens - 1) // bm.block_size
        return shared + width * (bm.blocks_for(max_total_tokens) - shared)

    def can_ever_fit(self, num_prompt_tokens: int, max_total_tokens: int, width: int = 1) -> bool:
        """Whether the group fits the KV pool when it runs alone."""
        return self.blocks_for_group(num_prompt_tokens, max_total_tokens, width) <= self.block_manager.num_blocks

    def add(self, group: SequenceGroup) -> None:
        if group.group_id in self._groups:
            raise ValueError(f"group {group.group_id} is already scheduled")
        if group.adapter is not None and not self.adapter_slots.num_slots:
            raise ValueError(
                f"group {group.group_id} needs adapter {group.adapter.name!r}; this group has no LoRA slots"
            )
        if group.is_beam and group.beam is None:
            group.beam = BeamSearch(group.sampling.beam_width, group.sampling.length_penalty)
        group.status = SequenceStatus.WAITING
        # A group moved here from a lost worker group may hold finished samples already.
        for seq in group.live():
            seq.status = SequenceStatus.WAITING
            stopping = seq.stopping
            seq.stop_ids = (
                stopping.stop_token_ids if stopping.ignore_eos else stopping.stop_token_ids | self.eos_token_ids
            )
            limit = self.max_model_len
            if stopping.max_tokens is not None:
                limit = min(limit, seq.num_prompt_tokens + stopping.max_tokens)
            seq.token_limit = limit
            self._seqs[seq.seq_id] = seq
        self._groups[group.group_id] = group
        self.enqueue(self.waiting, group)

    def finish_seq(self, seq_id: int, reason: FinishReason) -> bool:
        """End one sequence (e.g. on a stop string); returns whether its group ended too."""
        seq = self._seqs.get(seq_id)
        if seq is None or seq.is_finished:
            return False
        self._end_seq(seq, reason)
        group = seq.group
        assert group is not None
        if not group.live():
            self._end_group(group)
            return True
        return False

    def abort(self, group_id: int) -> SequenceGroup | None:
        """End a group wherever it is and free its blocks; unknown ids are ignored."""
        group = self._groups.get(group_id)
        if group is None:
            return None
        for seq in group.live():
            self._end_seq(seq, FinishReason.ABORTED)
        self._end_group(group)
        return group

    def abort_all(self) -> list[SequenceGroup]:
        return [g for g in (self.abort(i) for i in list(self._groups)) if g is not None]

    def evacuate(self) -> list[SequenceGroup]:
        """Take every unfinished group out, in line order, reset to be computed again elsewhere.

        For a lost worker group: its KV cache is gone, so each live sequence keeps its tokens
        (prompt and output so far) and starts from nothing computed, as after a recompute
        preemption. Blocks are freed, so this scheduler is left empty and consistent.
        """
        groups = sorted(self._groups.values(), key=lambda g: g.key)
        for group in groups:
            for seq in group.live():
                self.block_manager.free(seq.seq_id)
                del self._seqs[seq.seq_id]
                seq.num_computed_tokens = 0
                seq.status = SequenceStatus.WAITING
            group.status = SequenceStatus.WAITING
            # Step ids are this scheduler's own; the anti-thrash rule must not carry over.
            group.preempted_step = -1
        self.waiting.clear()
        self.running.clear()
        self.swapped.clear()
        self._groups.clear()
        self.running_slots = 0
        self.adapter_slots.reset()
        for record in self._in_flight:
            for seq in record.seqs:
                seq.pending = 0  # lost with the worker; computed again elsewhere
        self._in_flight.clear()
        self.block_manager.take_ops()
        return groups

    @property
    def has_work(self) -> bool:
        return bool(self._groups)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    def enqueue(self, queue: list[SequenceGroup], group: SequenceGroup) -> None:
        bisect.insort(queue, group, key=lambda g: g.key)

    def _end_seq(self, seq: Sequence, reason: FinishReason) -> None:
        self.block_manager.free(seq.seq_id)
        seq.pending = 0
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._seqs[seq.seq_id]

    def _end_group(self, group: SequenceGroup) -> None:
        if group.status is SequenceStatus.RUNNING:
            self.running_slots -= group.width
            if group.adapter is not None:
                self.adapter_slots.release(group.adapter)
        for queue in (self.running, self.waiting, self.swapped):
            if group in queue:
                queue.remove(group)
        group.status = SequenceStatus.FINISHED
        self._groups.pop(group.group_id, None)

    # ---- one step ----

    def schedule(self) -> StepPlan | None:
        """Pick this step's work; None when there is nothing to run, or when a plan is in flight
        and the next one cannot be planned before its result (see the module docstring)."""
        if len(self._in_flight) > 1 or (self._in_flight and not self._plan_ahead(self._in_flight[-1])):
            return None
        self.admitted.clear()
        seqs, query_lens = self._planner.pick()
        # An empty plan still carries pending block operations, and after a preemption it
        # ends the step so that the preempted group can come back in the next one.
        if not seqs and not self.block_manager.has_pending_ops and self._last_preempt_step != self._next_step_id:
            return None
        step_id = self._next_step_id
        self._next_step_id += 1
        self.num_planned_ahead += bool(self._in_flight)
        plan = self._builder.build(step_id, seqs, query_lens)
        self._in_flight.append(_InFlight(step_id, seqs, plan))
        return plan

    def _plan_ahead(self, record: _InFlight) -> bool:
        """Advance the state past the plan in flight, if the next plan cannot depend on its
        result; False (state unchanged) if it can."""
        head = self._planner.head()
        if head is not None and self.running and head.priority < self.running[-1].priority:
            return False  # it might preempt: wait for the result
        if any(g.needs_fork for g in self.running):
            return False  # its samples' copies of the shared block could run the pool short
        if record.advanced:
            return self._planner.running_need() <= self.block_manager.num_free_blocks
        for seq, samples in zip(record.seqs, record.plan.sample.tolist()):
            if seq.is_finished:
                continue
            group = seq.group
            assert group is not None
            if (
                group.width > 1
                or seq.sampling.penalized
                or seq.sampling.prompt_logprobs is not None
                # Its next mask follows the token in flight; a prompt chunk moves no grammar.
                or (seq.grammar is not None and samples)
            ):
                return False
        saved = [s.num_computed_tokens for s in record.seqs]
        self._advance(record)
        if self._planner.running_need() > self.block_manager.num_free_blocks:
            for seq, computed in zip(record.seqs, saved):  # no preemption ahead of a result
                seq.num_computed_tokens = computed
            for i in record.pending_rows:
                record.seqs[i].pending -= 1
            record.advanced, record.pending_rows = False, []
            return False
        return True

    def _advance(self, record: _InFlight) -> None:
        """Count the plan in flight as computed; its sampled tokens become pending."""
        plan = record.plan
        for i, (seq, c, q, sample) in enumerate(
            zip(record.seqs, plan.context_lens.tolist(), plan.query_lens.tolist(), plan.sample.tolist())
        ):
            if seq.is_finished:
                continue
            seq.num_computed_tokens = c + q
            # The last token the sequence may have needs no step after it.
            if sample and len(seq.token_ids) + 1 < seq.token_limit:
                seq.pending += 1
                record.pending_rows.append(i)
        record.advanced = True

    def preempt(self, group: SequenceGroup) -> PreemptionMode:
        """Give back the group's device blocks, by swap or recompute; it keeps its place in line."""
        bm = self.block_manager
        live = group.live()
        if any(seq.pending for seq in live):
            # Planning ahead never preempts (_plan_ahead); the token in flight would be lost.
            raise RuntimeError(f"group {group.request_id} preempted with a token in flight")
        ids = [s.seq_id for s in live]
        num_blocks = len(bm.unique_blocks(ids))
        computed = sum(s.num_computed_tokens for s in live)
        mode = self.policy.choose(num_blocks, computed, bm.cpu.num_free)
        self.running.remove(group)
        self.running_slots -= group.width
        if group.adapter is not None:
            self.adapter_slots.release(group.adapter)
        if mode is PreemptionMode.SWAP:
            group.swapped_blocks += bm.swap_out(ids)
            group.num_swaps += 1
            group.status = SequenceStatus.SWAPPED
            self.enqueue(self.swapped, group)
            self.num_swap_preemptions += 1
        else:
            for seq in live:
                bm.drop_device_blocks(seq.seq_id)
                seq.num_computed_tokens = 0
            group.status = SequenceStatus.WAITING
            self.enqueue(self.waiting, group)
            self.num_recompute_preemptions += 1
        for seq in live:
            seq.status = group.status
            seq.num_preemptions += 1
        group.num_preemptions += 1
        group.preempted_step = self._last_preempt_step = self._next_step_id
        self.num_preemptions += 1
        return mode

    def resume(self, group: SequenceGroup) -> None:
        """Move the head of swapped or waiting (StepPlanner.head) to running: swapped blocks come
        back in, a new prompt starts from its prefix-cache hit."""
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
        self.enqueue(self.running, group)
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

    def update(self, plan: StepPlan, result: StepResult) -> list[TokenEvent]:
        """Apply the worker's result of `plan` (the oldest plan in flight): advance the caches,
        append sampled tokens."""
        if not self._in_flight or self._in_flight[0].step_id != plan.step_id or result.step_id != plan.step_id:
            raise RuntimeError(f"update() for step {plan.step_id} does not match the plan in flight")
        record = self._in_flight.popleft()
        return self._apply(record, plan, result)

    def fork(self, parent: Sequence, index: int, seed: int) -> Sequence:
        """A new sequence of the parent's group sharing all its blocks."""
        child = parent.fork(self.new_seq_id(), index, seed)
        self.block_manager.fork(parent.seq_id, child.seq_id)
        assert parent.group is not None
        parent.group.seqs.append(child)
        self._seqs[child.seq_id] = child
        return child

    # ---- applying a result ----

    def _apply(self, record: _InFlight, plan: StepPlan, result: StepResult) -> list[TokenEvent]:
        seqs = record.seqs
        bm = self.block_manager
        bs = bm.block_size
        events: list[TokenEvent] = []
        query_lens = plan.query_lens.tolist()
        context_lens = plan.context_lens.tolist()
        pending_rows = set(record.pending_rows)
        sample = plan.sample.tolist()
        sampled = result.sampled_token_ids.tolist()
        logprobs = result.logprobs.tolist() if result.logprobs.shape[0] == len(seqs) else [0.0] * len(seqs)
        beam_rows: dict[SequenceGroup, list[int]] = {}
        has_top = result.top_token_ids.shape[0] == len(seqs)
        running = SequenceStatus.RUNNING
        for i, seq in enumerate(seqs):
            if seq.status is not running:
                continue
            c = context_lens[i]
            e = c + query_lens[i]
            if not record.advanced:  # else counted when the next plan was planned ahead
                seq.num_computed_tokens = e
            if e // bs != c // bs:  # a block filled up: index it
                bm.commit(seq.seq_id, seq.token_ids, e, seq.group.cache_salt if seq.group is not None else 0)
            if not sample[i]:
                continue
            if i in pending_rows:
                seq.pending -= 1
            if seq.sampling.beam_width > 1:
                assert seq.group is not None
                beam_rows.setdefault(seq.group, []).append(i)
                continue
            token, logprob = sampled[i], logprobs[i]
            if seq.grammar is not None and not seq.grammar.accept(token):
                # The worker applied the grammar's mask: either the mask allowed no token (a
                # grammar this vocabulary cannot spell) or the worker is broken. The output
                # cannot go on, and the token is not the client's to see: an event without one.
                ended = self.finish_seq(seq.seq_id, FinishReason.ABORTED)
                events.append(TokenEvent(seq, -1, 0.0, FinishReason.ABORTED, ended))
                continue
            seq.token_ids.append(token)
            seq.cumulative_logprob += logprob
            k = seq.sampling.logprobs
            top = (
                tuple(zip(result.top_token_ids[i, :k].tolist(), result.top_logprobs[i, :k].tolist()))
                if k and has_top
                else ()
            )
            # The common case, a token that neither stops nor reaches a limit, costs one set
            # lookup and one comparison; the rules themselves are Sequence.end_reason.
            reason = (
                seq.end_reason(token)
                if token in seq.stop_ids or len(seq.token_ids) >= seq.token_limit or seq.grammar is not None
                else None
            )
            if reason is None:
                events.append(TokenEvent(seq, token, logprob, None, False, top))
                continue
            ended = self.finish_seq(seq.seq_id, reason)
            events.append(TokenEvent(seq, token, logprob, reason, ended, top))
        if result.prompt_offsets.size:
            self._collect_prompt_logprobs(seqs, plan, result)
        for group, rows in beam_rows.items():
            events.extend(self._beam_step(group, [seqs[i] for i in rows], result, rows))
        return events

    def _collect_prompt_logprobs(self, seqs: list[Sequence], plan: StepPlan, result: StepResult) -> None:
        """Append the scores of prompt positions the group still lacks, in order; entry k of a
        row scores the token at position context + 1 + k, which may lie past the prompt."""
        offsets = result.prompt_offsets
        for i, seq in enumerate(seqs):
            begin, end = int(offsets[i]), int(offsets[i + 1])
            if begin == end or seq.group is None:
                continue
            store, prompt = seq.group.prompt_logprobs, seq.prompt_token_ids
            first_target = int(plan.context_lens[i]) + 1
            for k in range(begin, end):
                target = first_target + (k - begin)
                if target != len(store) + 1 or target >= len(prompt):
                    continue
                ids, lps = result.prompt_top_token_ids[k], result.prompt_top_logprobs[k]
                top = tuple((int(t), float(v)) for t, v in zip(ids, lps) if t >= 0)
                store.append((prompt[target], float(result.prompt_logprobs[k]), top))

    def _beam_step(
        self, group: SequenceGroup, beams: list[Sequence], result: StepResult, rows: list[int]
    ) -> list[TokenEvent]:
        assert group.beam is not None
        stop_ids = set(beams[0].stopping.stop_token_ids)
        if not beams[0].stopping.ignore_eos:
            stop_ids |= self.eos_token_ids
        ends = [b.end_reason(ahead=1) for b in beams]
        choice = group.beam.step(
            beams, result.top_token_ids[rows], result.top_logprobs[rows], ends, frozenset(stop_ids)
        )
        if choice.done:
            for seq in group.live():
                self._end_seq(seq, FinishReason.ABORTED)
            self._end_group(group)
            return [TokenEvent(group.seqs[0], -1, 0.0, None, True)]
        chosen: dict[Sequence, list[tuple[int, float]]] = {}
        for parent, token, score in choice.beams:
            chosen.setdefault(parent, []).append((token, score))
        for beam in beams:
            if beam not in chosen:
                self._end_seq(beam, FinishReason.ABORTED)
                group.seqs.remove(beam)
        for parent, picks in chosen.items():
            for token, score in picks[1:]:
                child = self.fork(parent, parent.index, parent.seed or 0)
                child.token_ids.append(token)
                child.cumulative_logprob = score
            parent.token_ids.append(picks[0][0])
            parent.cumulative_logprob = picks[0][1]
        return []

    def check_integrity(self) -> None:
        """Queues, sequence states and block tables agree with each other and with the pools."""
        bm = self.block_manager
        bm.check_integrity()
        queued = self.waiting + self.running + self.swapped
        if {g.group_id for g in queued} != set(self._groups) or len(queued) != len(self._groups):
            raise AssertionError("queues and the group index disagree")
        for queue in (self.waiting, self.running, self.swapped):
            if [g.key for g in queue] != sorted(g.key for g in queue):
                raise AssertionError("a queue is out of line order")
        for group in queued:
            for seq in group.live():
                if seq.status is not group.status:
                    raise AssertionError(f"seq {seq.seq_id} is {seq.status}, its group {group.status}")
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
        if len(self._seqs) != sum(len(g.live()) for g in queued):
            raise AssertionError("sequence index holds finished or unknown sequences")
