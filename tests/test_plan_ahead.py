"""Planning a step ahead of the result of the one in flight (Scheduler.schedule with a plan in
flight), against the same workload run one step at a time.

The fake worker keeps what it sampled for each sequence in its last step, as the real one
does, and fills deferred inputs from it; its token depends on the last fed token and the
position, so a deferred input filled wrongly, a token applied twice or a step skipped changes
every later token of that sequence.
"""

from __future__ import annotations

import random
from collections import deque

import numpy as np
import pytest

from common.config import SchedulerConfig
from common.plan import DEFERRED_INPUT, StepPlan, StepResult
from scheduler_svc.kv.block_manager import BlockManager
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.sequence import FinishReason, SamplingOptions, Sequence, SequenceStatus, StoppingParams
from scheduler_svc.sched.sequence_group import SequenceGroup

EOS = 2
VOCAB = 64


def _token(last: int, position: int) -> int:
    return (last * 7919 + position * 104729 + 13) % VOCAB


class CarryWorker:
    """Executes plans in order; deferred inputs come from its own last step."""

    def __init__(self) -> None:
        self.last: dict[int, int] = {}
        self.deferred = 0

    def execute(self, plan: StepPlan) -> StepResult:
        ends = np.cumsum(plan.query_lens)
        tokens = np.full(plan.num_seqs, -1, np.int32)
        carry: dict[int, int] = {}
        for i, seq_id in enumerate(plan.seq_ids.tolist()):
            fed = int(plan.input_ids[ends[i] - 1])
            if fed == DEFERRED_INPUT:
                fed = self.last[seq_id]  # KeyError: the worker did not sample it last step
                self.deferred += 1
            assert (plan.input_ids[ends[i] - plan.query_lens[i] : ends[i] - 1] >= 0).all(), "deferred input not last"
            if plan.sample[i]:
                tokens[i] = _token(fed, int(plan.context_lens[i] + plan.query_lens[i]))
                carry[seq_id] = int(tokens[i])
        self.last = carry
        return StepResult(plan.step_id, tokens, logprobs=np.zeros(plan.num_seqs, np.float32))


def _scheduler(num_blocks: int, **cfg: object) -> Scheduler:
    bm = BlockManager(num_blocks, 4, num_host_blocks=16, enable_prefix_caching=True)
    return Scheduler(SchedulerConfig(**cfg), bm, 256, frozenset({EOS}), block_bytes=1000)  # type: ignore[arg-type]


def _group(
    s: Scheduler, rid: int, prompt: list[int], max_tokens: int, priority: int = 0, **sampling: object
) -> SequenceGroup:
    params = SamplingOptions(**sampling)  # type: ignore[arg-type]
    seq = Sequence(
        s.queues.new_seq_id(),
        f"r{rid}",
        list(prompt),
        params,
        StoppingParams(max_tokens=max_tokens, ignore_eos=rid % 3 == 0),
        rid,
    )
    group = SequenceGroup(seq.request_id, [seq], params, rid, priority=priority)
    s.add(group)
    return group


def arrive_and_abort(
    s: Scheduler, step: int, pending: list[dict], workload: list[dict], groups: list[SequenceGroup]
) -> None:
    """Add the requests of `pending` (sorted by arrival) due at `step`, and abort those due then."""
    while pending and pending[0]["at"] <= step:
        w = pending.pop(0)
        width = w.get("sampling", {}).get("best_of", 1)
        if not s.can_ever_fit(len(w["prompt"]), len(w["prompt"]) + w["max_tokens"], width):
            continue  # the router refuses it (RESOURCE_EXHAUSTED): it would never run
        groups.append(_group(s, w["rid"], w["prompt"], w["max_tokens"], w.get("priority", 0), **w.get("sampling", {})))
        if w.get("abort_at") is not None:
            w["group"] = groups[-1]
    for w in workload:
        if w.get("abort_at") == step and "group" in w:
            s.abort(w["group"].group_id)


def _run(
    workload: list[dict], pipelined: bool, num_blocks: int, **cfg: object
) -> tuple[dict[str, list[list[int]]], int, int]:
    """Outputs by request, steps planned ahead, deferred inputs the worker filled."""
    s = _scheduler(num_blocks, **cfg)
    preempt = s.queues.preempt

    def preempt_only_between_results(group: SequenceGroup, step_id: int) -> object:
        assert not s._in_flight, "a preemption while a plan is in flight"  # noqa: SLF001
        return preempt(group, step_id)

    s.queues.preempt = preempt_only_between_results  # type: ignore[method-assign,assignment]
    worker = CarryWorker()
    groups: list[SequenceGroup] = []
    in_flight: deque[StepPlan] = deque()
    step = ahead = 0
    pending = sorted(workload, key=lambda w: w["at"])
    while pending or s.has_work or in_flight:
        arrive_and_abort(s, step, pending, workload, groups)
        while len(in_flight) < (2 if pipelined else 1):
            plan = s.schedule() if s.has_work else None
            if plan is None:
                break
            ahead += bool(in_flight)
            in_flight.append(plan)
        step += 1
        assert step < 20_000, "the scheduler stopped making progress"
        if not in_flight:
            continue
        plan = in_flight.popleft()
        for event in s.update(plan, worker.execute(plan)):
            # A "stop string" on token 5: the engine ends the sequence after update.
            if event.finish_reason is None and event.token_id == 5 and event.seq.request_id.endswith("7"):
                s.finish_seq(event.seq.seq_id, FinishReason.STOP_SEQUENCE)
        s.check_integrity()
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks
    assert all(seq.pending == 0 for g in groups for seq in g.seqs)
    return {g.request_id: [seq.output_token_ids for seq in g.seqs] for g in groups}, ahead, worker.deferred


def _workload(seed: int, n: int = 24, exotic: bool = True) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for rid in range(n):
        w: dict = {
            "rid": rid,
            "at": rng.randrange(0, 30),
            # Shared prefixes: prefix-cache hits across requests.
            "prompt": [7, 8, 9, 10, 11, 12, 13, 14][: rng.randrange(0, 9)]
            + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 30))],
            "max_tokens": rng.randrange(1, 40),
            "priority": rng.choice([0, 0, 0, 1]),
        }
        if exotic:
            kind = rng.randrange(8)
            if kind == 0:
                best_of = rng.choice([2, 3])
                w["sampling"] = {"n": 2, "best_of": best_of, "temperature": 1.0, "seed": rid}
            elif kind == 1:
                w["sampling"] = {"repetition_penalty": 1.2}
            elif kind == 2:
                w["sampling"] = {"prompt_logprobs": 1}
            elif kind == 3:
                w["abort_at"] = w["at"] + rng.randrange(1, 20)
        out.append(w)
    return out


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize(("num_blocks", "budget"), [(200, 48), (40, 48), (24, 8)])
def test_planning_ahead_changes_no_output(seed: int, num_blocks: int, budget: int) -> None:
    # Small pools: preemption by swap and recompute happens, only with the pipeline drained.
    workload = _workload(seed, n=30 if budget == 8 else 24)
    cfg = {"max_num_batched_tokens": budget, "max_num_seqs": 8}
    want, _, _ = _run([dict(w) for w in workload], pipelined=False, num_blocks=num_blocks, **cfg)
    got, ahead, deferred = _run([dict(w) for w in workload], pipelined=True, num_blocks=num_blocks, **cfg)
    aborted = {f"r{w['rid']}" for w in workload if w.get("abort_at") is not None}
    assert {r: o for r, o in got.items() if r not in aborted} == {r: o for r, o in want.items() if r not in aborted}
    # Planned ahead, a step can start a step later or sooner, so an abort at a fixed step can
    # catch another number of tokens: each aborted output is a prefix of its full output.
    full, _, _ = _run(
        [{k: v for k, v in w.items() if k != "abort_at"} for w in workload],
        pipelined=False,
        num_blocks=num_blocks,
        **cfg,
    )
    for r in aborted:
        assert all(f[: len(g)] == g for g, f in zip(got[r], full[r])), r
    assert ahead > 0 and deferred > 0


def test_plain_decodes_are_planned_ahead_every_step() -> None:
    workload = [{"rid": r, "at": 0, "prompt": [20 + r] * 5, "max_tokens": 30} for r in range(4)]
    want, _, _ = _run([dict(w) for w in workload], pipelined=False, num_blocks=100)
    got, ahead, deferred = _run([dict(w) for w in workload], pipelined=True, num_blocks=100)
    assert got == want
    # Every step but the first is planned while the one before it runs; every decode's input
    # but those of the first two steps is deferred.
    assert ahead >= 25 and deferred >= 4 * 25


def test_deferred_input_is_the_tokens_position_and_counts_it_as_output() -> None:
    s = _scheduler(50)
    group = _group(s, 1, [30, 31, 32], max_tokens=3)
    first = s.schedule()
    ahead = s.schedule()
    assert first is not None and ahead is not None
    assert first.input_ids.tolist() == [30, 31, 32] and first.sample.tolist() == [1]
    # The token the first step samples sits at position 3 and is the second step's input.
    assert ahead.input_ids.tolist() == [DEFERRED_INPUT] and ahead.context_lens.tolist() == [3]
    assert ahead.sampling.output_position.tolist() == [1] and ahead.sample.tolist() == [1]
    assert group.seqs[0].pending == 1 and group.seqs[0].num_tokens == 3
    assert s.schedule() is None
    worker = CarryWorker()
    s.update(first, worker.execute(first))
    assert group.seqs[0].pending == 0 and group.seqs[0].num_tokens == 4
    # The third token is the last (max_tokens 3): planned ahead, but nothing after it.
    last = s.schedule()
    assert last is not None and last.input_ids.tolist() == [DEFERRED_INPUT]
    s.update(ahead, worker.execute(ahead))
    assert s.schedule() is None and group.seqs[0].pending == 0
    s.update(last, worker.execute(last))
    assert group.seqs[0].finish_reason is FinishReason.LENGTH and group.seqs[0].num_output_tokens == 3
    assert s.block_manager.num_free_blocks == 50


@pytest.mark.parametrize(
    "sampling", [{"repetition_penalty": 1.3}, {"n": 2, "best_of": 2}, {"beam_width": 2}, {"prompt_logprobs": 0}]
)
def test_no_plan_ahead_when_the_result_decides_the_next_plan(sampling: dict) -> None:
    s = _scheduler(50)
    _group(s, 1, [30, 31, 32], max_tokens=5, **sampling)
    assert s.schedule() is not None
    assert s.schedule() is None


def test_no_plan_ahead_when_blocks_would_run_short() -> None:
    # Four sequences whose prompts fill their blocks: the next step's tokens need four new
    # blocks, and only two are free. Planned ahead, that step would have to preempt: wait for
    # the result instead.
    s = _scheduler(18)
    groups = [_group(s, r, [40 + r] * 16, max_tokens=10) for r in range(4)]
    plan = s.schedule()
    assert plan is not None and s.block_manager.num_free_blocks == 2
    computed = [g.seqs[0].num_computed_tokens for g in groups]
    assert s.schedule() is None
    assert [g.seqs[0].num_computed_tokens for g in groups] == computed  # nothing changed
    assert all(g.seqs[0].pending == 0 for g in groups)


def test_no_plan_ahead_past_a_waiting_group_of_higher_priority() -> None:
    s = _scheduler(50)
    _group(s, 1, [30, 31], max_tokens=9, priority=1)
    assert s.schedule() is not None
    _group(s, 2, [40, 41], max_tokens=9, priority=0)
    assert s.schedule() is None


def test_a_sequence_ending_on_the_token_in_flight_wastes_its_row_only() -> None:
    s = _scheduler(50)
    worker = CarryWorker()
    group = _group(s, 4, [3, 4], max_tokens=9)  # rid 4: eos not ignored
    first = s.schedule()
    ahead = s.schedule()
    assert first is not None and ahead is not None
    result = worker.execute(first)
    result.sampled_token_ids[0] = EOS  # this step's token ends the sequence
    worker.last[group.seqs[0].seq_id] = EOS
    events = s.update(first, result)
    assert events[0].finish_reason is FinishReason.STOP and group.status is SequenceStatus.FINISHED
    assert s.update(ahead, worker.execute(ahead)) == []  # its planned-ahead row is skipped
    assert group.seqs[0].output_token_ids == [EOS]
    assert s.block_manager.num_free_blocks == 50 and not s.has_work


def test_evacuating_with_plans_in_flight_forgets_the_pending_tokens() -> None:
    s = _scheduler(50)
    group = _group(s, 1, [30, 31, 32], max_tokens=8)
    assert s.schedule() is not None and s.schedule() is not None
    assert group.seqs[0].pending == 1
    moved = s.evacuate()
    assert moved == [group] and group.seqs[0].pending == 0 and group.seqs[0].num_computed_tokens == 0
    assert group.seqs[0].num_tokens == 3 and s.block_manager.num_free_blocks == 50
    # Computed again elsewhere, it produces what it would have.
    other = _scheduler(50)
    other.add(group)
    worker = CarryWorker()
    while other.has_work:
        plan = other.schedule()
        assert plan is not None
        other.update(plan, worker.execute(plan))
    want, _, _ = _run([{"rid": 1, "at": 0, "prompt": [30, 31, 32], "max_tokens": 8}], pipelined=False, num_blocks=50)
    assert [group.seqs[0].output_token_ids] == want["r1"]


def test_a_preemption_with_a_token_in_flight_is_refused() -> None:
    s = _scheduler(50)
    group = _group(s, 1, [30, 31, 32], max_tokens=8)
    assert s.schedule() is not None and s.schedule() is not None
    with pytest.raises(RuntimeError, match="token in flight"):
        s.queues.preempt(group, s.next_step_id)
