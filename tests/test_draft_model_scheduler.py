"""Draft-model speculation in the pure scheduler: a fake worker verifies the drafts and, as the
draft model would, proposes the next ones for the rows the plan asks, from the token it just
sampled. The scheduler must reserve the blocks the proposing writes, give them back after,
feed the proposals as the next step's drafts, and leave greedy outputs as without drafts."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from common.plan import StepPlan, StepResult
from common.speculative_config import SpeculativeConfig
from scheduler_svc.sched.scheduler import Scheduler
from tests.test_spec_scheduler import add, fake_worker, make, pattern

DRAFT = SpeculativeConfig(method="draft", num_speculative_tokens=3)
BLOCK = 4  # test_spec_scheduler.make's


def proposing_worker(
    target: Callable[[int], int], draft: Callable[[int], int]
) -> tuple[Callable[[StepPlan], StepResult], list[StepPlan]]:
    """fake_worker's verification, then `draft`'s tokens at the positions after each proposing
    row's new token; it checks every position it writes lies in the row's table."""
    verify, seen = fake_worker(target), []

    def execute(plan: StepPlan) -> StepResult:
        seen.append(plan)
        result = verify(plan)
        asked = plan.propose_lens
        if not asked.size:
            return result
        drafts = plan.draft_lens if plan.draft_lens.size else np.zeros(plan.num_seqs, np.int32)
        accepted = result.num_accepted if result.num_accepted.size else np.zeros(plan.num_seqs, np.int32)
        proposals: list[int] = []
        for i in np.flatnonzero(asked).tolist():
            assert plan.sample[i]
            at = int(plan.context_lens[i] + plan.query_lens[i] - drafts[i] + accepted[i])  # the new token's position
            last = at + int(asked[i]) - 1  # the last position the draft model writes
            assert plan.block_tables.lens[i] * BLOCK > last
            proposals += [draft(at + 1 + j) for j in range(int(asked[i]))]
        return StepResult(**{**result.__dict__, "draft_proposals": np.array(proposals, np.int32)})

    return execute, seen


def run(s: Scheduler, execute: Callable[[StepPlan], StepResult]) -> None:
    while (plan := s.schedule()) is not None:
        s.update(plan, execute(plan))
        s.check_integrity()
    assert not s.has_work and s.block_manager.num_free_blocks == s.block_manager.num_blocks


def prompts() -> list[list[int]]:
    return [[pattern(p) for p in range(9)], [7, 8, 9, 10, 11, 12], [5] * 17]


def wrong_after_two(position: int) -> int:
    """A draft model right for two positions in every five, wrong elsewhere."""
    return pattern(position) if position % 5 < 2 else 3


@pytest.mark.parametrize("draft", [pattern, wrong_after_two], ids=["perfect", "partly-wrong"])
def test_proposals_become_drafts_and_change_no_output(draft: Callable[[int], int]) -> None:
    outputs, steps = {}, {}
    for spec in (None, DRAFT):
        s = make(spec)
        seqs = [add(s, i, p, max_tokens=40) for i, p in enumerate(prompts())]
        execute, plans = proposing_worker(pattern, draft)
        run(s, execute)
        outputs[spec is not None] = [q.output_token_ids for q in seqs]
        steps[spec is not None] = len(plans)
    assert outputs[True] == outputs[False] == [[pattern(p) for p in range(len(q), len(q) + 40)] for q in prompts()]
    assert s.drafter is not None and s.drafter.drafted_total > 0
    if draft is pattern:  # every proposal kept: 4 tokens a step after the first
        assert s.drafter.accepted_total == s.drafter.drafted_total
        assert steps[True] <= steps[False] / 3
    else:
        assert 0 < s.drafter.accepted_total < s.drafter.drafted_total


def test_proposals_stop_at_the_token_limit_and_their_blocks_come_back() -> None:
    s = make(DRAFT)
    seq = add(s, 0, [pattern(p) for p in range(6)], max_tokens=5)
    execute, plans = proposing_worker(pattern, pattern)
    while (plan := s.schedule()) is not None:
        s.update(plan, execute(plan))
        if not seq.is_finished:  # past the step: the table holds the computed tokens only
            table = s.block_manager.tables[seq.seq_id]
            assert len(table) == -(-seq.num_computed_tokens // BLOCK)
    assert seq.output_token_ids == [pattern(p) for p in range(6, 11)]
    for plan in plans:
        if plan.propose_lens.size:  # never a proposal the next step could not feed
            ends = plan.context_lens + plan.query_lens
            assert int((ends + plan.propose_lens).max()) < 6 + 5
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks


def test_a_small_pool_preempts_and_keeps_outputs() -> None:
    s = make(DRAFT, num_blocks=14)
    seqs = [add(s, i, p, max_tokens=30) for i, p in enumerate(prompts())]
    execute, _ = proposing_worker(pattern, pattern)
    run(s, execute)
    assert [q.output_token_ids for q in seqs] == [[pattern(p) for p in range(len(q), len(q) + 30)] for q in prompts()]
    assert s.queues.num_preemptions > 0


def test_a_plan_that_asks_for_proposals_is_not_planned_ahead_of() -> None:
    s = make(DRAFT)
    add(s, 0, [pattern(p) for p in range(9)], max_tokens=20)
    first = s.schedule()
    assert first is not None and first.propose_lens.size and first.propose_lens[0] == 3
    assert s.schedule() is None  # the next drafts come with this plan's result
