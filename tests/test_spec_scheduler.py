"""Speculative decoding in the pure scheduler, driven by a fake worker that verifies drafts.

The fake model's token at a position depends only on the position (as in test_scheduler.py),
here through a repeating pattern, so that prompt lookup finds what comes next; a greedy
sequence must produce exactly the tokens it produces without drafts, whatever was drafted.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from common.config import SchedulerConfig
from common.plan import StepPlan, StepResult
from common.speculative_config import SpeculativeConfig
from scheduler_svc.kv.block_manager import BlockManager
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.sequence import FinishReason, SamplingOptions, Sequence, StoppingParams
from scheduler_svc.sched.sequence_group import SequenceGroup
from scheduler_svc.sched.suffix_index import SuffixIndex, draft

PERIOD = 11


def pattern(position: int) -> int:
    return 100 + (position * 5) % PERIOD


def fake_worker(target: Callable[[int], int]) -> Callable[[StepPlan], StepResult]:
    """Greedy verification: draft j of a row stands at position c + 1 + j and is kept while
    it is the target's token there; the token after the kept ones is the target's."""

    def execute(plan: StepPlan) -> StepResult:
        ends = (plan.context_lens + plan.query_lens).tolist()
        drafts = plan.draft_lens.tolist() if plan.draft_lens.size else [0] * plan.num_seqs
        starts = np.concatenate([[0], np.cumsum(plan.query_lens)]).tolist()
        tokens = np.full(plan.num_seqs, -1, np.int32)
        accepted = np.zeros(plan.num_seqs, np.int32)
        for i in np.flatnonzero(plan.sample).tolist():
            d, e = drafts[i], ends[i]
            first = e - d  # the position of the first draft
            fed = plan.input_ids[starts[i + 1] - d : starts[i + 1]].tolist()
            a = 0
            while a < d and fed[a] == target(first + a):
                a += 1
            accepted[i] = a
            tokens[i] = target(first + a)
        if not any(drafts):
            return StepResult(plan.step_id, tokens)
        total = int(sum(drafts))
        return StepResult(plan.step_id, tokens, num_accepted=accepted, draft_logprobs=np.zeros(total, np.float32))

    return execute


def make(spec: SpeculativeConfig | None, num_blocks: int = 256, **config: object) -> Scheduler:
    return Scheduler(
        SchedulerConfig(speculative=spec, **config),  # type: ignore[arg-type]
        BlockManager(num_blocks=num_blocks, block_size=4, num_host_blocks=64),
        max_model_len=4096,
        eos_token_ids=frozenset({2}),
        block_bytes=1000,
    )


def add(s: Scheduler, seq_id: int, prompt: list[int], max_tokens: int, **stopping: object) -> Sequence:
    seq = Sequence(
        seq_id=seq_id,
        request_id=f"r{seq_id}",
        prompt_token_ids=prompt,
        sampling=SamplingOptions(),
        stopping=StoppingParams(max_tokens=max_tokens, **stopping),  # type: ignore[arg-type]
        arrival=seq_id,
    )
    s.add(SequenceGroup.of(seq, 0))
    return seq


def run(s: Scheduler, target: Callable[[int], int]) -> list[StepPlan]:
    execute, plans = fake_worker(target), []
    while (plan := s.schedule()) is not None:
        s.update(plan, execute(plan))
        s.check_integrity()
        plans.append(plan)
    assert not s.has_work and s.block_manager.num_free_blocks == s.block_manager.num_blocks
    return plans


SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=3)


def prompts() -> list[list[int]]:
    return [[pattern(p) for p in range(40)], [pattern(p) for p in range(13)], [7, 8, 9, 10, 11, 12]]


def test_drafts_change_no_greedy_output_and_save_steps() -> None:
    outputs, steps = {}, {}
    for spec in (None, SPEC):
        s = make(spec)
        seqs = [add(s, i, p, max_tokens=60) for i, p in enumerate(prompts())]
        steps[spec is not None] = len(run(s, pattern))
        outputs[spec is not None] = [q.output_token_ids for q in seqs]
    assert outputs[True] == outputs[False]
    assert all(len(o) == 60 for o in outputs[True])
    assert steps[True] < steps[False] / 2  # four drafts a step, nearly all kept
    assert s.drafter is not None and s.drafter.accepted_total > 0.8 * s.drafter.drafted_total


def test_a_stop_token_among_the_kept_drafts_ends_the_sequence_there() -> None:
    s = make(SPEC)
    stop = pattern(45)
    seq = add(s, 0, [pattern(p) for p in range(40)], max_tokens=100, stop_token_ids=frozenset({stop}))
    run(s, pattern)
    assert seq.output_token_ids[-1] == stop and stop not in seq.output_token_ids[:-1]
    assert seq.finish_reason is FinishReason.STOP
    assert seq.output_token_ids == [pattern(p) for p in range(40, 40 + len(seq.output_token_ids))]


@pytest.mark.parametrize("max_tokens", [1, 3, 7])
def test_drafts_never_pass_max_tokens(max_tokens: int) -> None:
    s = make(SPEC)
    seq = add(s, 0, [pattern(p) for p in range(40)], max_tokens=max_tokens)
    plans = run(s, pattern)
    assert seq.output_token_ids == [pattern(p) for p in range(40, 40 + max_tokens)]
    assert all(int(p.query_lens.max()) <= 1 + max_tokens for p in plans[1:])


def test_a_batch_above_the_limit_drafts_nothing() -> None:
    s = make(SpeculativeConfig(num_speculative_tokens=2, disable_by_batch_size=2))
    for i in range(3):
        add(s, i, [pattern(p) for p in range(20 + i)], max_tokens=10)
    plans = run(s, pattern)
    running_three = [p for p in plans if p.num_seqs == 3]
    assert running_three and all(not p.draft_lens.size or not p.draft_lens.any() for p in running_three)


def test_a_sequence_whose_drafts_fail_rests() -> None:
    """A model whose tokens come from the prompt's alphabet in no order: n-grams keep
    matching and their drafts keep failing, so after a review the sequence stops drafting for
    a while (its output is unchanged)."""
    noise = np.random.default_rng(1).integers(100, 100 + PERIOD, 400).tolist()
    drafted = {}
    for rate in (0.0, 0.5):
        s = make(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, min_acceptance_rate=rate))
        seq = add(s, 0, [pattern(p) for p in range(40)], max_tokens=120)
        run(s, lambda p: noise[p])
        assert seq.output_token_ids == noise[40:160]
        assert s.drafter is not None and s.drafter.accepted_total < 0.3 * s.drafter.drafted_total
        drafted[rate] = s.drafter.drafted_total
    assert 0 < drafted[0.5] < 0.6 * drafted[0.0]


@pytest.mark.parametrize(("temperature", "first_rest"), [(0.0, 8), (1.0, 64)])
def test_each_failed_review_in_a_row_rests_twice_as_long_and_a_good_one_resets(
    temperature: float, first_rest: int
) -> None:
    """A greedy sequence rests 8 tokens after a failing review (its text mostly comes back to
    what it copies), a sampled one 64 (its matches are chance)."""
    from types import SimpleNamespace

    from scheduler_svc.sched.draft_state import DraftState
    from scheduler_svc.sched.drafter import Drafter
    from scheduler_svc.sched.ngram_index import NgramIndex

    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=4, min_acceptance_rate=0.5))
    sampling = SamplingOptions(temperature=temperature)
    seq = SimpleNamespace(draft_state=DraftState(NgramIndex(2, 4, 64)), token_ids=[1] * 100, sampling=sampling)
    rests = []
    for accepted in (0, 0, 0, 16, 0):
        drafter.record(seq, 16, accepted)  # type: ignore[arg-type]  # one review of 16 drafts
        rests.append(seq.draft_state.rest_until - len(seq.token_ids))
        seq.draft_state.rest_until = 0
    # Twice as long after each of three failing reviews; none after a good one, which starts over.
    assert rests == [first_rest, 2 * first_rest, 4 * first_rest, -100, first_rest]


@pytest.mark.parametrize(("temperature", "reviewed"), [(0.0, False), (1.0, True)])
def test_a_sampled_sequence_is_reviewed_after_8_drafts_a_greedy_one_after_16(
    temperature: float, reviewed: bool
) -> None:
    from types import SimpleNamespace

    from scheduler_svc.sched.draft_state import DraftState
    from scheduler_svc.sched.drafter import Drafter
    from scheduler_svc.sched.ngram_index import NgramIndex

    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=4))
    state = DraftState(NgramIndex(2, 4, 64))
    seq = SimpleNamespace(draft_state=state, token_ids=[1] * 100, sampling=SamplingOptions(temperature=temperature))
    drafter.record(seq, 8, 0)  # type: ignore[arg-type]
    assert (state.rest_until > 100) is reviewed


def test_preemption_under_a_small_pool_keeps_outputs() -> None:
    outputs = {}
    for spec in (None, SPEC):
        s = make(spec, num_blocks=40, preemption_mode="recompute")
        seqs = [add(s, i, [pattern(p) for p in range(30 + i)], max_tokens=40) for i in range(4)]
        run(s, pattern)
        outputs[spec is not None] = [q.output_token_ids for q in seqs]
        assert s.queues.num_preemptions > 0 or spec is None
    assert outputs[True] == outputs[False]


def test_suffix_drafts_walk_the_most_frequent_continuation() -> None:
    own, shared = SuffixIndex(3), SuffixIndex(3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    own.follow(tokens, 1000)
    # after [1, 2]: 3 (three times); after [1, 2, 3]: 4 twice, 9 once; then [2, 3, 4] -> 1
    assert draft((own, shared), tokens, 4, 0.3) == [3, 4, 1, 2]
    assert draft((own, shared), tokens, 4, 0.9) == [3]  # 4 followed [1, 2, 3] 2 times in 3
    shared.extend([7, 7, 8, 5, 6], 0)  # another request's output
    assert draft((own, shared), [8, 5], 2, 0.3) == [6]  # only the shared index knows [8, 5]


def test_suffix_drafts_from_earlier_requests_outputs() -> None:
    """Requests that write the same thing: the second drafts from the first one's output at
    once. Ten tokens are fewer than the pattern's period, so nothing within one request
    repeats: every kept draft comes from the other request."""
    spec = SpeculativeConfig(method="suffix", num_speculative_tokens=4, prompt_lookup_max=4)
    s = make(spec)
    first = add(s, 0, [1, 2, 3], max_tokens=10)
    run(s, pattern)
    assert s.drafter is not None and s.drafter.accepted_total == 0
    second = add(s, 1, [1, 2, 3], max_tokens=10)
    run(s, pattern)
    assert s.drafter.accepted_total >= 6
    assert first.output_token_ids == [pattern(p) for p in range(3, 13)]
    assert second.output_token_ids == first.output_token_ids


def test_suffix_drafting_changes_no_greedy_output() -> None:
    spec = SpeculativeConfig(method="suffix", num_speculative_tokens=3, prompt_lookup_max=4)
    outputs = {}
    for config in (None, spec):
        s = make(config)
        seqs = [add(s, i, p, max_tokens=50) for i, p in enumerate(prompts())]
        run(s, pattern)
        outputs[config is not None] = [q.output_token_ids for q in seqs]
    assert outputs[True] == outputs[False]


@pytest.mark.parametrize("kept_lately", [False, True])
def test_a_sequence_whose_drafts_were_kept_lately_keeps_the_next_plan_waiting(kept_lately: bool) -> None:
    """Without drafts in flight, the next plan is planned ahead, unless a sequence in the step
    had drafts kept within its last few tokens: then it waits, to draft from the token in flight."""
    from scheduler_svc.sched.draft_state import DraftState
    from scheduler_svc.sched.ngram_index import NgramIndex

    s = make(SPEC)
    seq = add(s, 0, [7, 8, 9, 10, 11, 12], max_tokens=20)
    if kept_lately:
        seq.draft_state = DraftState(NgramIndex(2, 3, 8192), last_kept=len(seq.token_ids) - 2)
    first = s.schedule()
    assert first is not None and not first.draft_lens.size
    ahead = s.schedule()
    assert (ahead is None) is kept_lately
    if kept_lately:  # a rest ends it: the sequence may not draft then
        seq.draft_state.rest_until = 100  # type: ignore[union-attr]
        assert s.drafter is not None and not s.drafter.productive(seq)


@pytest.mark.parametrize(("temperature", "waits"), [(0.0, True), (1.0, False)])
def test_a_greedy_sequence_whose_tokens_propose_a_draft_keeps_the_next_plan_waiting(
    temperature: float, waits: bool
) -> None:
    """Text that has begun to repeat itself: the step in flight decodes a token without drafts,
    but the tokens before it already propose some. Greedy, the next plan waits to draft from the
    token in flight; sampled (chance matches), it is planned ahead until a draft is kept."""
    s = make(SPEC)
    seq = add(s, 0, [7, 8, 9, 10, 11, 7, 8], max_tokens=20)
    seq.sampling = SamplingOptions(temperature=temperature, seed=1)
    first = s.schedule()
    assert first is not None and not first.draft_lens.size
    assert s.drafter is not None and s.drafter.productive(seq) is waits  # [7, 8] was followed by 9
    assert (s.schedule() is None) is waits


@pytest.mark.parametrize(("found", "waits"), [(1, False), (2, True)])
def test_in_a_batch_a_quarter_of_the_sequences_must_have_had_drafts_kept_to_wait(found: int, waits: bool) -> None:
    """A few sequences whose drafts were kept in a large batch do not hold the whole batch's next
    plan back: 1 of 5 plans ahead, 2 of 5 wait."""
    from scheduler_svc.sched.draft_state import DraftState
    from scheduler_svc.sched.ngram_index import NgramIndex

    s = make(SPEC)
    seqs = [add(s, i, [7 + i, 8, 9, 10, 11, 12], max_tokens=20) for i in range(5)]
    for seq in seqs[:found]:
        seq.draft_state = DraftState(NgramIndex(2, 3, 8192), last_kept=len(seq.token_ids))
    first = s.schedule()
    assert first is not None and first.num_seqs == 5
    assert (s.schedule() is None) is waits
