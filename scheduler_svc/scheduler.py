"""Continuous batching over three queues: waiting, running, swapped.

Pure and synchronous: `schedule()` returns the next StepPlan, `update(plan, result)` applies
the worker's answer and returns token events. No I/O, no clock, no asyncio; the engine loop
does all of that and is the only caller, so nothing here needs a lock.

The unit is a request's `SequenceGroup`. Every queue is ordered by the group's place in line,
(priority, arrival), which preemption never changes. Each step, under a token budget:

  1. Running groups in line order feed what they lack (a prompt chunk, or 1 token per
     sequence). When blocks run short, the group last in line is preempted, by swap or by
     recompute, whichever `PreemptionPolicy` finds cheaper.
  2. Unless step 1 preempted something, the heads of swapped and waiting are resumed or
     admitted in line order (so a swapped group comes back before any later arrival), as long
     as the budget, `max_num_seqs` and the free blocks above a watermark allow. New prompts
     start from their longest prefix-cache hit. Admission stops at the first group that does
     not fit: nobody is overtaken, so nobody starves.
  3. Before either, a waiting or swapped group of strictly higher priority than the last
     running one, that does not fit, preempts running groups of lower priority until it fits.

Why this cannot thrash or livelock:
  - the victim is always the group last in line, so the group first in line is never
    preempted while another runs, and always progresses;
  - a step that had to preempt admits nothing, and a group resumes only with a watermark of
    blocks plus one block per sequence to spare, so it is not evicted by its own next token;
  - priority preemption only displaces strictly lower priority: equal priorities never
    preempt each other, and the displaced group keeps its place in line;
  - admission refuses (RESOURCE_EXHAUSTED) a group that could not fit the pool alone.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from common.config import SchedulerConfig
from common.plan import StepPlan, StepResult
from scheduler_svc.beam_search import BeamSearch
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.plan_builder import build_plan
from scheduler_svc.preemption import PreemptionMode, PreemptionPolicy
from scheduler_svc.sequence import FinishReason, Sequence, SequenceStatus
from scheduler_svc.sequence_group import SequenceGroup


@dataclass(frozen=True)
class TokenEvent:
    """A token appended to `seq` this step; `finish_reason` is set if it ended the sequence.

    Beams report no tokens: their group's end is a single event with token_id -1.
    """

    seq: Sequence
    token_id: int
    logprob: float
    finish_reason: FinishReason | None
    group_finished: bool


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        block_bytes: int = 0,
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
        self._ids: Iterator[int] = itertools.count()
        self._next_step_id = 0
        self._in_flight: tuple[int, list[Sequence]] | None = None
        self._watermark_blocks = int(config.watermark * block_manager.num_blocks)
        # Sequence slots held by running groups (a group holds its widest count: best_of or beam width).
        self.running_slots = 0
        # Counters for metrics.
        self.num_preemptions = 0
        self.num_swap_preemptions = 0
        self.num_recompute_preemptions = 0
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    # ---- queue changes (called by the engine loop between steps) ----

    def new_seq_id(self) -> int:
        return next(self._ids)

    def blocks_for_group(self, num_prompt_tokens: int, max_total_tokens: int, width: int) -> int:
        """Blocks a group needs at its largest: the prompt once, every sequence's own tail."""
        bm = self.block_manager
        shared = num_prompt_tokens // bm.block_size
        return shared + width * (bm.blocks_for(max_total_tokens) - shared)

    def can_ever_fit(self, num_prompt_tokens: int, max_total_tokens: int, width: int = 1) -> bool:
        """Whether the group fits the KV pool when it runs alone."""
        return self.blocks_for_group(num_prompt_tokens, max_total_tokens, width) <= self.block_manager.num_blocks

    def add(self, group: SequenceGroup) -> None:
        if group.group_id in self._groups:
            raise ValueError(f"group {group.group_id} is already scheduled")
        if group.is_beam and group.beam is None:
            group.beam = BeamSearch(group.sampling.beam_width, group.sampling.length_penalty)
        group.status = SequenceStatus.WAITING
        for seq in group.seqs:
            seq.status = SequenceStatus.WAITING
            self._seqs[seq.seq_id] = seq
        self._groups[group.group_id] = group
        self._enqueue(self.waiting, group)

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

    def _enqueue(self, queue: list[SequenceGroup], group: SequenceGroup) -> None:
        bisect.insort(queue, group, key=lambda g: g.key)

    def _end_seq(self, seq: Sequence, reason: FinishReason) -> None:
        self.block_manager.free(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._seqs[seq.seq_id]

    def _end_group(self, group: SequenceGroup) -> None:
        if group.status is SequenceStatus.RUNNING:
            self.running_slots -= group.max_seqs
        for queue in (self.running, self.waiting, self.swapped):
            if group in queue:
                queue.remove(group)
        group.status = SequenceStatus.FINISHED
        self._groups.pop(group.group_id, None)

    # ---- one step ----

    def schedule(self) -> StepPlan | None:
        """Pick this step's work; None when there is nothing to run."""
        if self._in_flight is not None:
            raise RuntimeError("schedule() called again before update() of the previous plan")
        seqs, query_lens = self._pick()
        if not seqs:
            return None
        step_id = self._next_step_id
        self._next_step_id += 1
        self._in_flight = (step_id, seqs)
        return build_plan(step_id, seqs, query_lens, self.block_manager)

    def preempt(self, group: SequenceGroup) -> PreemptionMode:
        """Give back the group's device blocks, by swap or recompute; it keeps its place in line."""
        bm = self.block_manager
        live = group.live()
        ids = [s.seq_id for s in live]
        num_blocks = len(bm.unique_blocks(ids))
        computed = sum(s.num_computed_tokens for s in live)
        mode = self.policy.choose(num_blocks, computed, bm.cpu.num_free)
        self.running.remove(group)
        self.running_slots -= group.max_seqs
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
        self.num_preemptions += 1
        return mode

    def update(self, plan: StepPlan, result: StepResult) -> list[TokenEvent]:
        """Apply the worker's result of `plan`: advance the caches, append sampled tokens."""
        if self._in_flight is None or self._in_flight[0] != plan.step_id or result.step_id != plan.step_id:
            raise RuntimeError(f"update() for step {plan.step_id} does not match the plan in flight")
        _, seqs = self._in_flight
        self._in_flight = None
        return self._apply(seqs, plan, result)

    # ---- choosing a step ----

    def _pick(self) -> tuple[list[Sequence], list[int]]:
        bm = self.block_manager
        budget = self.config.max_num_batched_tokens
        seqs: list[Sequence] = []
        query_lens: list[int] = []
        self._preempt_for_priority(budget)
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            group = self.running[i]
            rows = self._rows(group, budget)
            need = self._blocks_needed(rows)
            while need > bm.num_free_blocks:
                victim = self.running[-1]
                self.preempt(victim)
                preempted = True
                if victim is group:
                    break
            if group.status is not SequenceStatus.RUNNING:
                break
            budget -= self._take(rows, seqs, query_lens)
            i += 1
        # A step that had to preempt admits nothing, unless nothing else would run at all.
        if not preempted or not seqs:
            self._admit(budget, seqs, query_lens)
        return seqs, query_lens

    def _take(self, rows: list[tuple[Sequence, int]], seqs: list[Sequence], query_lens: list[int]) -> int:
        """Allocate the rows' blocks and add them to the step; returns the tokens they feed."""
        bm = self.block_manager
        used = 0
        for seq, q in rows:
            bm.allocate(seq.seq_id, seq.num_computed_tokens + q, seq.num_computed_tokens)
            seqs.append(seq)
            query_lens.append(q)
            used += q
        return used

    def _blocks_needed(self, rows: list[tuple[Sequence, int]]) -> int:
        """An upper bound: forks sharing one block count its copy once each."""
        bm = self.block_manager
        return sum(bm.blocks_needed(s.seq_id, s.num_computed_tokens + q, s.num_computed_tokens) for s, q in rows)

    def _rows(self, group: SequenceGroup, budget: int) -> list[tuple[Sequence, int]]:
        """What each of the group's sequences feeds this step, within `budget` tokens."""
        if group.needs_fork and group.seqs[0].num_tokens - group.seqs[0].num_computed_tokens == 1:
            self._fork_samples(group)
        rows: list[tuple[Sequence, int]] = []
        complete = True
        for seq in group.live():
            left = seq.num_tokens - seq.num_computed_tokens
            q = min(left, budget)
            if group.needs_fork:
                q = min(q, left - 1)  # stop before the last prompt token: the fork happens there
            complete = complete and q == left
            if q > 0:
                rows.append((seq, q))
                budget -= q
        if group.is_beam and not complete:
            # Beams sample together or not at all: cap each below its last token until every
            # beam's catch-up (after a recompute) fits one step.
            capped = [(s, min(q, s.num_tokens - s.num_computed_tokens - 1)) for s, q in rows]
            rows = [(s, q) for s, q in capped if q > 0]
        return rows

    def _fork_samples(self, group: SequenceGroup) -> None:
        parent = group.seqs[0]
        for index in range(1, group.sampling.best_of):
            child = parent.fork(self.new_seq_id(), index, group.sampling.sample_seed(index))
            self.block_manager.fork(parent.seq_id, child.seq_id)
            group.seqs.append(child)
            self._seqs[child.seq_id] = child
        group.forked = True

    def _head(self) -> SequenceGroup | None:
        """The next group in line to resume or admit."""
        w = self.waiting[0] if self.waiting else None
        s = self.swapped[0] if self.swapped else None
        if w is None or (s is not None and s.key < w.key):
            return s
        return w

    def _admission_need(self, group: SequenceGroup, budget: int) -> int:
        """Free blocks resuming or admitting `group` takes this step, at most."""
        bm = self.block_manager
        ids = [s.seq_id for s in group.live()]
        if group.status is SequenceStatus.SWAPPED:
            # Its blocks, plus one per sequence so its next tokens do not evict it again.
            return len(bm.unique_blocks(ids, host=True)) + len(ids)
        need = 0
        for seq in group.live():
            hit = bm.prefix_hit(seq.seq_id, seq.token_ids)
            start = len(hit) * bm.block_size
            left = seq.num_tokens - start
            q = min(left, budget)
            if group.needs_fork:
                # Forking now: every sample may write its last prompt token into a block of its own.
                q, extra = (1, group.sampling.best_of - 1) if left == 1 else (min(q, left - 1), 0)
                need += extra
            need += bm.admission_cost(hit, start + q)
            budget -= q
        return need

    def _fits(self, group: SequenceGroup, budget: int, reserve: int = 0) -> bool:
        if self.running_slots + group.max_seqs > self.config.max_num_seqs:
            return False
        reserve += self._watermark_blocks if self.running else 0
        return self._admission_need(group, budget) + reserve <= self.block_manager.num_free_blocks

    def _running_need(self, budget: int) -> int:
        """Blocks the running groups take this step, at most (read-only, unlike `_rows`)."""
        bm = self.block_manager
        need = 0
        for group in self.running:
            for seq in group.live():
                c = seq.num_computed_tokens
                q = min(seq.num_tokens - c, budget)
                need += bm.blocks_needed(seq.seq_id, c + q, c)
        return need

    def _preempt_for_priority(self, budget: int) -> None:
        head = self._head()
        while (
            head is not None
            and self.running
            and self.running[-1].priority > head.priority
            and not self._fits(head, budget, reserve=self._running_need(budget))
        ):
            self.preempt(self.running[-1])

    def _admit(self, budget: int, seqs: list[Sequence], query_lens: list[int]) -> None:
        bm = self.block_manager
        while budget > 0:
            group = self._head()
            if group is None or not self._fits(group, budget):
                return
            if group.status is SequenceStatus.SWAPPED:
                self.swapped.pop(0)
                group.swapped_blocks += bm.swap_in([s.seq_id for s in group.live()])
            else:
                self.waiting.pop(0)
                self._attach_prefixes(group)
            group.status = SequenceStatus.RUNNING
            for seq in group.live():
                seq.status = SequenceStatus.RUNNING
            self._enqueue(self.running, group)
            self.running_slots += group.max_seqs
            rows = self._rows(group, budget)
            if self._blocks_needed(rows) <= bm.num_free_blocks:
                budget -= self._take(rows, seqs, query_lens)

    def _attach_prefixes(self, group: SequenceGroup) -> None:
        bm = self.block_manager
        for seq in group.live():
            hit = bm.prefix_hit(seq.seq_id, seq.token_ids)
            bm.attach(seq.seq_id, hit)
            seq.num_computed_tokens = len(hit) * bm.block_size
            group.prefix_hit_tokens += seq.num_computed_tokens
            self.prefix_hit_tokens += seq.num_computed_tokens
            self.prefix_queried_tokens += seq.num_tokens

    # ---- applying a result ----

    def _apply(self, seqs: list[Sequence], plan: StepPlan, result: StepResult) -> list[TokenEvent]:
        bm = self.block_manager
        events: list[TokenEvent] = []
        query_lens = plan.query_lens.tolist()
        sample = plan.sample.tolist()
        sampled = result.sampled_token_ids.tolist()
        logprobs = result.logprobs.tolist() if result.logprobs.shape[0] == len(seqs) else [0.0] * len(seqs)
        beam_rows: dict[SequenceGroup, list[int]] = {}
        for i, seq in enumerate(seqs):
            if seq.status is not SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens += query_lens[i]
            bm.commit(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            if not sample[i]:
                continue
            group = seq.group
            assert group is not None
            if group.is_beam:
                beam_rows.setdefault(group, []).append(i)
                continue
            token, logprob = sampled[i], logprobs[i]
            seq.token_ids.append(token)
            seq.cumulative_logprob += logprob
            reason = self.stop_reason(seq, token)
            ended = self.finish_seq(seq.seq_id, reason) if reason is not None else False
            events.append(TokenEvent(seq, token, logprob, reason, ended))
        for group, rows in beam_rows.items():
            events.extend(self._beam_step(group, [seqs[i] for i in rows], result, rows))
        return events

    def _beam_step(self, group: SequenceGroup, beams: list[Sequence], result: StepResult, rows: list[int]) -> list[TokenEvent]:
        assert group.beam is not None
        stop_ids = set(beams[0].stopping.stop_token_ids)
        if not beams[0].stopping.ignore_eos:
            stop_ids |= self.eos_token_ids
        ends = [self._beam_end(b) for b in beams]
        choice = group.beam.step(beams, result.top_token_ids[rows], result.top_logprobs[rows], ends, frozenset(stop_ids))
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
                child = parent.fork(self.new_seq_id(), parent.index, parent.seed or 0)
                self.block_manager.fork(parent.seq_id, child.seq_id)
                group.seqs.append(child)
                self._seqs[child.seq_id] = child
                child.token_ids.append(token)
                child.cumulative_logprob = score
            parent.token_ids.append(picks[0][0])
            parent.cumulative_logprob = picks[0][1]
        return []

    def _beam_end(self, beam: Sequence) -> FinishReason | None:
        """Why one more token would end this beam, whatever the token."""
        max_tokens = beam.stopping.max_tokens
        if max_tokens is not None and beam.num_output_tokens + 1 >= max_tokens:
            return FinishReason.LENGTH
        if beam.num_tokens + 1 >= self.max_model_len:
            return FinishReason.CONTEXT_LENGTH
        return None

    def stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        """Why appending `token` ends `seq` (token already appended)."""
        stopping = seq.stopping
        if token in stopping.stop_token_ids or (not stopping.ignore_eos and token in self.eos_token_ids):
            return FinishReason.STOP
        if stopping.max_tokens is not None and seq.num_output_tokens >= stopping.max_tokens:
            return FinishReason.LENGTH
        if seq.num_tokens >= self.max_model_len:
            return FinishReason.CONTEXT_LENGTH
        return None

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
                if group.status is SequenceStatus.SWAPPED and (table or len(host) < bm.blocks_for(seq.num_computed_tokens)):
                    raise AssertionError(f"swapped seq {seq.seq_id} has blocks out of place")
                if group.status is SequenceStatus.RUNNING:
                    if host or len(table) < bm.blocks_for(seq.num_computed_tokens):
                        raise AssertionError(f"running seq {seq.seq_id} has {len(table)} blocks for {seq.num_computed_tokens} tokens")
        if self.running_slots != sum(g.max_seqs for g in self.running):
            raise AssertionError(f"running slots counter says {self.running_slots}")
        if len(self._seqs) != sum(len(g.live()) for g in queued):
            raise AssertionError("sequence index holds finished or unknown sequences")
