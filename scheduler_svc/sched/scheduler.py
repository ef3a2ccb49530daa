"""Continuous batching over three queues: waiting, running, swapped.

Pure and synchronous: `schedule()` returns the next StepPlan, `update(plan, result)` applies
the worker's answer and returns token events. No I/O, no clock, no asyncio; the engine loop
does all of that and is the only caller, so nothing here needs a lock.

The unit is a request's `SequenceGroup`. `Queues` holds the three queues, ordered by the
group's place in line (priority, arrival), and the verbs that move groups between them;
`StepPlanner` chooses each step's work (the batching, admission and preemption policy is
described there) and `PlanBuilder` turns it into a StepPlan. This class plans ahead and
applies results: sampled tokens, stop conditions, beam steps.

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

Micro-batches: a pipelined worker group (`pipeline_stages` > 1) runs one plan per stage at a
time, so `schedule()` keeps up to `micro_batches` plans in flight (by default one per stage and
one more, or one for stages on one CPU: `_default_micro_batches`), over disjoint groups: while
the last stage runs plan k, the first already runs plan k + 1. Nothing is planned ahead there
(no plan names a token still in flight, so the stages never send tokens back to the first):
a group in a plan in flight waits for its result before it is planned or preempted again, and
each plan takes its share of the idle running sequences (`_share`). The plans are applied in
the order they were made, the order every stage runs them in, which is also what makes a
block freed by an abort safe to hand to the next plan.

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

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from common.config import MAX_MICROBATCHES, SchedulerConfig
from common.plan import StepPlan, StepResult
from scheduler_svc.kv.block_manager import BlockManager
from scheduler_svc.lora.adapter_slots import AdapterSlots
from scheduler_svc.sched.beam_search import BeamSearch
from scheduler_svc.sched.drafter import Drafter
from scheduler_svc.sched.plan_builder import PlanBuilder
from scheduler_svc.sched.preemption import PreemptionPolicy
from scheduler_svc.sched.queues import Queues
from scheduler_svc.sched.sequence import FinishReason, Sequence
from scheduler_svc.sched.sequence_group import SequenceGroup, shared_prompt_blocks
from scheduler_svc.sched.step_planner import StepPlanner
from scheduler_svc.sched.token_events import ResultApplier, TokenEvent


def _default_micro_batches(stages: int, share_cores: bool) -> int:
    """Plans in flight for a pipeline: one per stage and one more, which covers the scheduler's
    turn-around (apply a result, plan, send) as planning ahead does without stages; with one per
    stage exactly, the first stage waits for it. Stages that are a CPU's ranks share its cores
    and memory bandwidth, so running them at once gains nothing and smaller batches cost weight
    reads: they take turns (SmolLM2 at pp = 2 on two cores: 419 output tok/s one plan at a
    time, 109 with three plans and both ranks' thread teams fighting for the cores, 296 with a
    core each)."""
    return 1 if share_cores else stages + 1


# Speculative decoding: at most this many plans in a row are planned ahead (which drafts nothing).
_DRAFT_PROBE = 4
# ... and none at all while at least 1 in this many of the step's sequences had drafts kept lately.
_PRODUCTIVE_SHARE = 4


@dataclass
class _InFlight:
    """A plan sent to the worker whose result has not been applied yet."""

    step_id: int
    seqs: list[Sequence]
    plan: StepPlan
    groups: frozenset[int]  # micro-batches: the ids of the groups it runs (busy until it is applied)
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
        pipeline_stages: int = 1,
        stages_share_cores: bool = False,
    ) -> None:
        if pipeline_stages < 1:
            raise ValueError(f"pipeline_stages must be at least 1, got {pipeline_stages}")
        self.config = config
        self.micro_batches = (
            min(
                config.pipeline_microbatches or _default_micro_batches(pipeline_stages, stages_share_cores),
                MAX_MICROBATCHES,
            )
            if pipeline_stages > 1
            else 1
        )
        self._may_plan_ahead = config.plan_ahead and pipeline_stages == 1
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.queues = Queues(
            block_manager, PreemptionPolicy.of(config, block_bytes), AdapterSlots(num_lora_slots), seq_ids
        )
        self._next_step_id = 0
        # At most max_in_flight: one running and one planned ahead, or one per micro-batch.
        self._in_flight: deque[_InFlight] = deque()
        self.drafter = Drafter(config.speculative) if config.speculative is not None else None
        self._planner = StepPlanner(self.queues, config, self.drafter)
        self._results = ResultApplier(self.queues, eos_token_ids, self.drafter)
        self._builder = PlanBuilder(
            block_manager, self.queues.adapter_slots, self.queues.groups, speculative=self.drafter is not None
        )
        self.num_planned_ahead = 0
        self._ahead_streak = 0  # plans planned ahead in a row while drafting may pay

    # ---- queue changes (called by the engine loop between steps) ----

    @property
    def max_in_flight(self) -> int:
        """Plans the engine may keep sent before the oldest one's result is applied."""
        if self.micro_batches > 1:
            return self.micro_batches
        return 2 if self._may_plan_ahead else 1

    @property
    def next_step_id(self) -> int:
        """Id of the step being planned."""
        return self._next_step_id

    @property
    def num_adapter_loads(self) -> int:
        """LoRA adapters put into a slot so far (each is read onto the device once more)."""
        return self.queues.adapter_slots.num_loads

    def blocks_for_group(self, num_prompt_tokens: int, max_total_tokens: int, width: int) -> int:
        """Blocks a group needs at its largest: the prompt once, every sequence's own tail.

        The block holding the last prompt token counts as each sequence's own: samples fork
        before that token and each writes it, and a recomputed group (preempted, or moved from
        a lost worker group) shares only the blocks before it (`shared_prompt_blocks`). Counting
        it shared would admit a group its own admission check could never take back.
        """
        bm = self.block_manager
        shared = shared_prompt_blocks(num_prompt_tokens, bm.block_size)
        return shared + width * (bm.blocks_for(max_total_tokens) - shared)

    def can_ever_fit(self, num_prompt_tokens: int, max_total_tokens: int, width: int = 1) -> bool:
        """Whether the group fits the KV pool when it runs alone."""
        return self.blocks_for_group(num_prompt_tokens, max_total_tokens, width) <= self.block_manager.num_blocks

    def add(self, group: SequenceGroup) -> None:
        if group.group_id in self.queues.groups:
            raise ValueError(f"group {group.group_id} is already scheduled")
        if group.adapter is not None and not self.queues.adapter_slots.num_slots:
            raise ValueError(
                f"group {group.group_id} needs adapter {group.adapter.name!r}; this group has no LoRA slots"
            )
        if group.is_beam and group.beam is None:
            group.beam = BeamSearch(group.sampling.beam_width, group.sampling.length_penalty)
        # A group moved here from a lost worker group may hold finished samples already.
        for seq in group.live():
            stopping = seq.stopping
            seq.stop_ids = (
                stopping.stop_token_ids if stopping.ignore_eos else stopping.stop_token_ids | self.eos_token_ids
            )
            limit = self.max_model_len
            if stopping.max_tokens is not None:
                limit = min(limit, seq.num_prompt_tokens + stopping.max_tokens)
            seq.token_limit = limit
        self.queues.add(group)

    def finish_seq(self, seq_id: int, reason: FinishReason) -> bool:
        """End one sequence (e.g. on a stop string); returns whether its group ended too."""
        return self.queues.finish_seq(seq_id, reason)

    def abort(self, group_id: int) -> SequenceGroup | None:
        """End a group wherever it is and free its blocks; unknown ids are ignored."""
        return self.queues.abort(group_id)

    def abort_all(self) -> list[SequenceGroup]:
        return [g for g in (self.abort(i) for i in list(self.queues.groups)) if g is not None]

    def evacuate(self) -> list[SequenceGroup]:
        """Take every unfinished group out, in line order, reset to be computed again elsewhere.

        For a lost worker group: its KV cache is gone, so each live sequence keeps its tokens
        (prompt and output so far) and starts from nothing computed, as after a recompute
        preemption. Blocks are freed, so this scheduler is left empty and consistent.
        """
        groups = self.queues.take_all()
        for record in self._in_flight:
            for seq in record.seqs:
                seq.pending = 0  # lost with the worker; computed again elsewhere
                seq.draft, seq.propose = [], 0
        self._in_flight.clear()
        self.block_manager.take_ops()
        return groups

    @property
    def has_work(self) -> bool:
        return bool(self.queues.groups)

    @property
    def num_waiting(self) -> int:
        return len(self.queues.waiting)

    @property
    def num_running(self) -> int:
        return len(self.queues.running)

    @property
    def num_swapped(self) -> int:
        return len(self.queues.swapped)

    # ---- one step ----

    def schedule(self) -> StepPlan | None:
        """Pick this step's work; None when there is nothing to run, or when a plan is in flight
        and the next one cannot be planned before its result (see the module docstring)."""
        if self._in_flight:
            if self.micro_batches > 1:
                if len(self._in_flight) >= self.micro_batches:
                    return None
            elif len(self._in_flight) > 1 or not self._may_plan_ahead or not self._plan_ahead(self._in_flight[-1]):
                return None
        self.queues.admitted.clear()
        busy, max_rows = self._share()
        seqs, query_lens = self._planner.pick(self._next_step_id, busy, max_rows)
        # An empty plan still carries pending block operations, and after a preemption it
        # ends the step so that the preempted group can come back in the next one.
        if not seqs and not self.block_manager.has_pending_ops and self.queues.last_preempt_step != self._next_step_id:
            return None
        step_id = self._next_step_id
        self._next_step_id += 1
        self.num_planned_ahead += bool(self._in_flight) and self.micro_batches == 1
        plan = self._builder.build(step_id, seqs, query_lens)
        groups = frozenset(s.group_id for s in seqs) if self.micro_batches > 1 else frozenset()
        self._in_flight.append(_InFlight(step_id, seqs, plan, groups))
        return plan

    def _share(self) -> tuple[frozenset[int], int | None]:
        """For a micro-batch: the groups of the plans in flight, which it must leave alone, and
        the most running sequences it takes: the idle ones split evenly over the plans still
        to fill, so that every stage of the pipeline gets about as much work."""
        if self.micro_batches == 1:
            return frozenset(), None
        busy = frozenset().union(*(record.groups for record in self._in_flight))
        idle = sum(g.width for g in self.queues.running if g.group_id not in busy)
        open_plans = self.micro_batches - len(self._in_flight)
        return busy, -(-idle // open_plans)

    def _plan_ahead(self, record: _InFlight) -> bool:
        """Advance the state past the plan in flight, if the next plan cannot depend on its
        result; False (state unchanged) if it can."""
        queues = self.queues
        head = queues.head()
        if head is not None and queues.running and head.priority < queues.running[-1].priority:
            return False  # it might preempt: wait for the result
        if any(g.needs_fork for g in queues.running):
            return False  # its samples' copies of the shared block could run the pool short
        if record.advanced:
            return self._planner.running_need() <= self.block_manager.num_free_blocks
        if record.plan.propose_lens.size:
            return False  # the draft model's proposals come with its result: the next drafts
        if self.drafter is not None and len(queues.running) <= self.drafter.config.disable_by_batch_size:
            # A sequence drafts only from known tokens, never past a token in flight. So a
            # plan with drafts waits for its result (how many are kept decides where the next
            # step starts), and so does one where a quarter of the sequences had drafts kept
            # lately (their text repeats: they may draft again from the token in flight; a few
            # such in a large batch would not pay for the whole batch's wait); else it plans
            # ahead but lets every few steps wait, so that text that starts to repeat gets drafts.
            self._ahead_streak += 1
            drafter = self.drafter
            if (
                (record.plan.draft_lens.size and record.plan.draft_lens.any())
                or self._ahead_streak >= _DRAFT_PROBE
                or _PRODUCTIVE_SHARE * sum(map(drafter.productive, record.seqs)) >= len(record.seqs)
            ):
                self._ahead_streak = 0
                return False
        for seq, samples in zip(record.seqs, record.plan.sample.tolist()):
            if seq.is_finished:
                continue
            if (
                queues.group_of(seq).width > 1
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

    def update(self, plan: StepPlan, result: StepResult) -> list[TokenEvent]:
        """Apply the worker's result of `plan` (the oldest plan in flight): advance the caches,
        append sampled tokens."""
        if not self._in_flight or self._in_flight[0].step_id != plan.step_id or result.step_id != plan.step_id:
            raise RuntimeError(f"update() for step {plan.step_id} does not match the plan in flight")
        record = self._in_flight.popleft()
        events = self._results.apply(
            record.seqs, plan, result, advanced=record.advanced, pending_rows=record.pending_rows
        )
        if self.drafter is not None:
            for event in events:
                if event.finish_reason is not None:
                    self.drafter.finished(event.seq)
        return events

    def check_integrity(self) -> None:
        """Queues, sequence states and block tables agree with each other and with the pools."""
        self.queues.check_integrity()
