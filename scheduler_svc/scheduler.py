"""Continuous batching: which sequences run this step, and how many tokens each feeds.

Pure and synchronous: `schedule()` returns the next StepPlan, `update(plan, result)` applies
the worker's answer and returns token events. No I/O, no clock, no asyncio; the engine loop
does all of that and is the only caller, so nothing here needs a lock.

Policy, each step, under a token budget (`max_num_batched_tokens`):
  1. running sequences, oldest first, each feeds what it still lacks (1 token in decode, or the
     next chunk of a long prompt). When blocks run out, the latest arrival is preempted by
     recompute: its blocks are freed, its tokens (output included) are kept, and it goes back
     to the head of the waiting queue to be prefilled again later.
  2. then, if nothing was preempted, waiting sequences in arrival order while the budget,
     `max_num_seqs` and the free blocks (minus a watermark) allow; a prompt larger than the
     remaining budget is admitted as a chunk and continues next step.
The oldest running sequence is never a victim while a later one exists, so it always makes
progress: the queue cannot livelock as long as every admitted request fits the pool alone,
which admission checks (`can_ever_fit`).
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

import numpy as np

from common.config import SchedulerConfig
from common.plan import SamplingBatch, StepPlan, StepResult
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(frozen=True)
class TokenEvent:
    """A token sampled for `seq` this step; `finish_reason` is set if it ended the sequence."""

    seq: Sequence
    token_id: int
    finish_reason: FinishReason | None


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # sorted by arrival
        self._by_id: dict[int, Sequence] = {}
        self._next_step_id = 0
        self._in_flight: tuple[int, list[Sequence]] | None = None
        self._watermark_blocks = int(config.watermark * block_manager.num_blocks)
        self.num_preemptions = 0

    # ---- queue changes (called by the engine loop between steps) ----

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` tokens fits the KV pool when it runs alone."""
        return self.block_manager.blocks_for(num_tokens) <= self.block_manager.num_blocks

    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self._by_id:
            raise ValueError(f"sequence {seq.seq_id} is already scheduled")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._by_id[seq.seq_id] = seq

    def finish(self, seq_id: int, reason: FinishReason) -> Sequence | None:
        """End a sequence wherever it is and free its blocks; unknown ids are ignored."""
        seq = self._by_id.pop(seq_id, None)
        if seq is None:
            return None
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        return seq

    def abort(self, seq_id: int) -> Sequence | None:
        return self.finish(seq_id, FinishReason.ABORTED)

    def abort_all(self) -> list[Sequence]:
        return [s for s in (self.abort(i) for i in list(self._by_id)) if s is not None]

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- one step ----

    def schedule(self) -> StepPlan | None:
        """Pick this step's work; None when there is nothing to run."""
        if self._in_flight is not None:
            raise RuntimeError("schedule() called again before update() of the previous plan")
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        scheduled: list[tuple[Sequence, int]] = []
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not bm.can_allocate(seq.seq_id, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            bm.allocate(seq.seq_id, seq.num_computed_tokens + n)
            scheduled.append((seq, n))
            budget -= n
            i += 1

        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            # With nothing running the watermark would only block the queue forever.
            reserve = self._watermark_blocks if self.running else 0
            if not bm.can_allocate(seq.seq_id, seq.num_computed_tokens + n, reserve):
                break
            self.waiting.popleft()
            bm.allocate(seq.seq_id, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.arrival)
            scheduled.append((seq, n))
            budget -= n

        if not scheduled:
            return None
        step_id = self._next_step_id
        self._next_step_id += 1
        self._in_flight = (step_id, [seq for seq, _ in scheduled])
        return self._build_plan(step_id, scheduled)

    def _preempt(self, seq: Sequence) -> None:
        """Preempt by recompute: drop the KV blocks, keep every token, requeue at the head."""
        self.running.remove(seq)
        self.block_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _build_plan(self, step_id: int, scheduled: list[tuple[Sequence, int]]) -> StepPlan:
        n = len(scheduled)
        tables = [self.block_manager.block_table(seq.seq_id) for seq, _ in scheduled]
        # Padding is -1, never a real block: a stray use of it fails loudly instead of reading
        # or writing someone else's block.
        block_tables = np.full((n, max(len(t) for t in tables)), -1, dtype=np.int32)
        input_ids: list[int] = []
        for row, (table, (seq, q)) in enumerate(zip(tables, scheduled)):
            block_tables[row, : len(table)] = table
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start : start + q])
        seqs = [seq for seq, _ in scheduled]
        query_lens = np.fromiter((q for _, q in scheduled), np.int32, n)
        context_lens = np.fromiter((s.num_computed_tokens for s in seqs), np.int32, n)
        num_tokens = np.fromiter((s.num_tokens for s in seqs), np.int32, n)
        return StepPlan(
            step_id=step_id,
            seq_ids=np.fromiter((s.seq_id for s in seqs), np.int64, n),
            query_lens=query_lens,
            context_lens=context_lens,
            input_ids=np.asarray(input_ids, dtype=np.int32),
            block_tables=block_tables,
            sample=(context_lens + query_lens == num_tokens).astype(np.uint8),
            sampling=SamplingBatch(
                temperature=np.fromiter((s.sampling.temperature for s in seqs), np.float32, n),
                top_p=np.fromiter((s.sampling.top_p for s in seqs), np.float32, n),
                top_k=np.fromiter((s.sampling.top_k for s in seqs), np.int32, n),
                seed=np.array([s.sampling.seed for s in seqs], dtype=np.uint64).view(np.int64),
                output_position=np.fromiter((s.num_output_tokens for s in seqs), np.int32, n),
            ),
        )

    def update(self, plan: StepPlan, result: StepResult) -> list[TokenEvent]:
        """Apply the worker's result of `plan`: advance the caches, append sampled tokens."""
        if self._in_flight is None or self._in_flight[0] != plan.step_id or result.step_id != plan.step_id:
            raise RuntimeError(f"update() for step {plan.step_id} does not match the plan in flight")
        _, seqs = self._in_flight
        self._in_flight = None
        events: list[TokenEvent] = []
        sampled = result.sampled_token_ids
        for i, seq in enumerate(seqs):
            if seq.is_finished:
                continue
            seq.num_computed_tokens += int(plan.query_lens[i])
            if not plan.sample[i]:
                continue
            token = int(sampled[i])
            seq.token_ids.append(token)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self.finish(seq.seq_id, reason)
            events.append(TokenEvent(seq, token, reason))
        return events

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        stopping = seq.stopping
        if token in stopping.stop_token_ids or (not stopping.ignore_eos and token in self.eos_token_ids):
            return FinishReason.STOP
        if stopping.max_tokens is not None and seq.num_output_tokens >= stopping.max_tokens:
            return FinishReason.LENGTH
        if seq.num_tokens >= self.max_model_len:
            return FinishReason.CONTEXT_LENGTH
        return None

    def check_integrity(self) -> None:
        """Queues and block tables agree with each other and with the pool."""
        self.block_manager.check_integrity()
        queued = {s.seq_id for s in self.waiting} | {s.seq_id for s in self.running}
        if queued != set(self._by_id):
            raise AssertionError("queues and the sequence index disagree")
        for seq in self.waiting:
            if seq.num_computed_tokens or self.block_manager.block_table(seq.seq_id):
                raise AssertionError(f"waiting seq {seq.seq_id} holds KV state")
        for seq in self.running:
            have = len(self.block_manager.block_table(seq.seq_id))
            if have < self.block_manager.blocks_for(seq.num_computed_tokens):
                raise AssertionError(f"running seq {seq.seq_id} has {have} blocks for {seq.num_computed_tokens} tokens")
