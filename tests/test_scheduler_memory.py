"""KV memory management in the pure scheduler: swap and recompute preemption, priority,
prefix caching, forked samples and beams, driven by a fake stateless worker.

The fake worker's answer for a row depends only on what the plan says about that row (its
last fed token, position and seed), like a real model's. A sequence must therefore produce
the same tokens whether it ran alone, was swapped, recomputed or re-batched.
"""

from __future__ import annotations

import numpy as np
import pytest

from common.config import SchedulerConfig
from common.plan import StepPlan, StepResult
from scheduler_svc.kv.block_manager import BlockManager
from scheduler_svc.sched.preemption import PreemptionMode, PreemptionPolicy
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.sequence import FinishReason, SamplingOptions, Sequence, StoppingParams
from scheduler_svc.sched.sequence_group import SequenceGroup
from scheduler_svc.sched.token_events import TokenEvent

EOS = 2
VOCAB = 50


def _mix(*values: int) -> int:
    h = 0x811C9DC5
    for v in values:
        h = ((h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


class FakeRows:
    """A fake step result, row by row: each sampled row draws from a fixed distribution of its
    key, in which token t has logprob -score(t); top-k ranks that distribution."""

    def __init__(self, plan: StepPlan) -> None:
        n = plan.num_seqs
        k = int(plan.sampling.num_logprobs.max()) if n and plan.sampling.num_logprobs.size else 0
        self.plan = plan
        self.tokens = np.full(n, -1, np.int32)
        self.logprobs = np.full(n, np.nan, np.float32)
        self.top_ids = np.full((n, k), -1, np.int32)
        self.top_lps = np.full((n, k), -np.inf, np.float32)

    def sample(self, i: int, *key: int) -> None:
        sampling = self.plan.sampling
        scores = [(_mix(*key, t) % 1000) / 100 for t in range(VOCAB)]
        order = sorted(range(VOCAB), key=lambda t: (scores[t], t))
        pick = order[0]
        if sampling.temperature[i] > 0:
            pick = order[_mix(int(sampling.seed[i]), int(sampling.output_position[i])) % 5]
        self.tokens[i] = pick
        self.logprobs[i] = -scores[pick]
        width = int(sampling.num_logprobs[i]) if sampling.num_logprobs.size else 0
        self.top_ids[i, :width] = order[:width]
        self.top_lps[i, :width] = [-scores[t] for t in order[:width]]

    def result(self) -> StepResult:
        return StepResult(
            self.plan.step_id,
            self.tokens,
            logprobs=self.logprobs,
            top_token_ids=self.top_ids,
            top_logprobs=self.top_lps,
        )


def fake_execute(plan: StepPlan) -> StepResult:
    """Token = f(last fed token, position[, seed when sampling]); top-k ranks a fixed fake distribution."""
    n = plan.num_seqs
    ends = plan.context_lens + plan.query_lens
    last = plan.input_ids[np.cumsum(plan.query_lens) - 1] if n else np.zeros(0, np.int32)
    rows = FakeRows(plan)
    for i in range(n):
        if plan.sample[i]:
            rows.sample(i, int(last[i]), int(ends[i]))
    return rows.result()


def make_scheduler(
    num_blocks: int,
    num_cpu_blocks: int = 0,
    block_size: int = 4,
    prefix_caching: bool = True,
    block_bytes: int = 1000,
    max_model_len: int = 1024,
    **cfg: object,
) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, num_host_blocks=num_cpu_blocks, enable_prefix_caching=prefix_caching)
    return Scheduler(SchedulerConfig(**cfg), bm, max_model_len, frozenset({EOS}), block_bytes=block_bytes)  # type: ignore[arg-type]


def make_group(
    s: Scheduler, prompt: list[int], max_tokens: int | None, arrival: int, priority: int = 0, **sampling: object
) -> SequenceGroup:
    params = SamplingOptions(**sampling)  # type: ignore[arg-type]
    seq = Sequence(
        s.queues.new_seq_id(),
        f"r{arrival}",
        list(prompt),
        params,
        StoppingParams(max_tokens=max_tokens, ignore_eos=True),
        arrival,
    )
    group = SequenceGroup(seq.request_id, [seq], params, arrival, priority=priority)
    s.add(group)
    return group


def prompt_of(i: int, length: int) -> list[int]:
    return [10 + (i * 7 + j) % 37 for j in range(length)]


def drive(s: Scheduler, max_steps: int = 5000) -> tuple[list[StepPlan], list[TokenEvent]]:
    plans, events = [], []
    for _ in range(max_steps):
        plan = s.schedule()
        if plan is None:
            break
        events += s.update(plan, fake_execute(plan))
        s.check_integrity()
        plans.append(plan)
    assert not s.has_work
    bm = s.block_manager
    assert bm.device.num_free == bm.num_blocks and bm.host.num_free == bm.host.num_blocks
    return plans, events


def outputs_alone(prompt: list[int], max_tokens: int, **sampling: object) -> list[list[int]]:
    s = make_scheduler(num_blocks=256)
    group = make_group(s, prompt, max_tokens, 0, **sampling)
    drive(s)
    return [seq.output_token_ids for seq in group.seqs]


# ---- preemption ----


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
def test_preempted_requests_produce_exactly_their_undisturbed_tokens(mode: str) -> None:
    s = make_scheduler(num_blocks=14, num_cpu_blocks=40, preemption_mode=mode)
    groups = [make_group(s, prompt_of(i, 5 + i % 3), 10, i) for i in range(6)]
    plans, _ = drive(s)
    assert s.queues.num_preemptions > 0
    if mode == "swap":
        assert s.queues.num_swap_preemptions == s.queues.num_preemptions
        assert any(p.swap_out.size for p in plans) and any(p.swap_in.size for p in plans)
    if mode == "recompute":
        assert s.queues.num_recompute_preemptions == s.queues.num_preemptions
        assert not any(p.swap_out.size or p.swap_in.size for p in plans)
    for i, g in enumerate(groups):
        assert g.seqs[0].output_token_ids == outputs_alone(prompt_of(i, 5 + i % 3), 10)[0]
    assert groups[0].num_preemptions == 0  # first in line is never the victim


def test_a_full_swap_pool_falls_back_to_recompute_and_both_are_counted() -> None:
    s = make_scheduler(num_blocks=14, num_cpu_blocks=4, preemption_mode="auto", block_bytes=1)
    groups = [make_group(s, prompt_of(i, 6), 10, i) for i in range(6)]
    drive(s)
    assert s.queues.num_swap_preemptions > 0 and s.queues.num_recompute_preemptions > 0
    assert sum(g.num_swaps for g in groups) == s.queues.num_swap_preemptions
    assert sum(g.swapped_blocks for g in groups) > 0


def test_swap_ops_move_exact_blocks_out_and_back() -> None:
    s = make_scheduler(num_blocks=5, num_cpu_blocks=8, preemption_mode="swap", prefix_caching=False)
    a = make_group(s, prompt_of(0, 4), 8, 0)
    b = make_group(s, prompt_of(1, 4), 8, 1)
    plans, _ = drive(s)
    out = next(p for p in plans if p.swap_out.size)
    back = next(p for p in plans if p.swap_in.size)
    assert out.step_id < back.step_id
    # The victim is b (last in line); its host blocks come back to the device, in table order.
    assert out.swap_out[:, 1].tolist() == list(range(len(out.swap_out)))
    assert back.swap_in[:, 0].tolist() == out.swap_out[:, 1].tolist()
    assert b.num_swaps == 1 and a.num_swaps == 0
    assert b.swapped_blocks == 2 * len(out.swap_out)


def test_cost_model_picks_the_cheaper_way() -> None:
    policy = PreemptionPolicy(mode="auto", block_bytes=1_000_000, swap_bytes_per_s=1e9, recompute_tokens_per_s=1000)
    # 10 blocks: 20 ms of copying; 100 tokens: 100 ms of prefill -> swap.
    assert policy.choose(num_blocks=10, num_tokens=100, free_host_blocks=64) is PreemptionMode.SWAP
    # 10 tokens: 10 ms of prefill -> recompute.
    assert policy.choose(num_blocks=10, num_tokens=10, free_host_blocks=64) is PreemptionMode.RECOMPUTE
    assert policy.choose(num_blocks=10, num_tokens=100, free_host_blocks=9) is PreemptionMode.RECOMPUTE
    forced = PreemptionPolicy("recompute", 1_000_000, 1e9, 1000)
    assert forced.choose(10, 10_000, 64) is PreemptionMode.RECOMPUTE


def test_no_admission_in_a_step_that_preempted() -> None:
    s = make_scheduler(num_blocks=10, num_cpu_blocks=40, preemption_mode="swap")
    for i in range(8):
        make_group(s, prompt_of(i, 6), 12, i)
    plans, _ = drive(s)
    for p in plans:
        if p.swap_out.size:
            assert not p.swap_in.size  # nothing resumed in a step that had to swap out


def test_swapped_group_resumes_before_a_later_arrival() -> None:
    s = make_scheduler(num_blocks=5, num_cpu_blocks=8, preemption_mode="swap", prefix_caching=False)
    make_group(s, prompt_of(0, 4), 8, 0)
    b = make_group(s, prompt_of(1, 4), 8, 1)
    while b.num_swaps == 0:
        plan = s.schedule()
        assert plan is not None
        s.update(plan, fake_execute(plan))
    c = make_group(s, prompt_of(2, 4), 2, 2)
    resumed = admitted = None
    step = 0
    while s.has_work:
        plan = s.schedule()
        assert plan is not None
        ids = plan.seq_ids.tolist()
        if resumed is None and b.seqs[0].seq_id in ids:
            resumed = step
        if admitted is None and c.seqs[0].seq_id in ids:
            admitted = step
        s.update(plan, fake_execute(plan))
        step += 1
    assert resumed is not None and admitted is not None and resumed <= admitted


# ---- priority ----


def test_high_priority_request_preempts_lower_priority_ones() -> None:
    s = make_scheduler(num_blocks=8, num_cpu_blocks=16, max_num_seqs=8)
    low = [make_group(s, prompt_of(i, 6), 20, i, priority=5) for i in range(3)]
    for _ in range(3):
        plan = s.schedule()
        assert plan is not None
        s.update(plan, fake_execute(plan))
    urgent = make_group(s, prompt_of(9, 6), 4, 10, priority=-1)
    plan = s.schedule()
    assert plan is not None and urgent.seqs[0].seq_id in plan.seq_ids.tolist()
    assert sum(g.num_preemptions for g in low) >= 1
    s.update(plan, fake_execute(plan))
    drive(s)
    assert urgent.seqs[0].output_token_ids == outputs_alone(prompt_of(9, 6), 4)[0]
    for i, g in enumerate(low):
        assert g.seqs[0].output_token_ids == outputs_alone(prompt_of(i, 6), 20)[0]


def test_equal_priority_never_preempts_for_admission() -> None:
    s = make_scheduler(num_blocks=8, num_cpu_blocks=16)
    first = [make_group(s, prompt_of(i, 6), 20, i) for i in range(3)]
    plan = s.schedule()
    assert plan is not None
    s.update(plan, fake_execute(plan))
    make_group(s, prompt_of(9, 6), 4, 10)
    plan = s.schedule()
    assert plan is not None
    assert all(g.num_preemptions == 0 for g in first)


def test_waiting_queue_is_ordered_by_priority_then_arrival() -> None:
    s = make_scheduler(num_blocks=64, max_num_seqs=1)
    groups = [make_group(s, prompt_of(i, 3), 1, i, priority=p) for i, p in enumerate([3, 1, 2, 1])]
    order = []
    while s.has_work:
        plan = s.schedule()
        assert plan is not None
        order += [sid for sid in plan.seq_ids.tolist() if sid not in order]
        s.update(plan, fake_execute(plan))
    assert order == [groups[i].group_id for i in (1, 3, 2, 0)]


# ---- prefix caching ----


def test_repeated_prompt_is_served_from_the_prefix_cache() -> None:
    s = make_scheduler(num_blocks=32)
    prompt = prompt_of(3, 18)  # 4 full blocks of 4 + 2 tokens
    first = make_group(s, prompt, 5, 0)
    drive(s)
    second = make_group(s, prompt, 5, 1)
    plans, _ = drive(s)
    assert plans[0].context_lens.tolist() == [16] and plans[0].query_lens.tolist() == [2]
    assert second.prefix_hit_tokens == 16 and first.prefix_hit_tokens == 0
    assert second.seqs[0].output_token_ids == first.seqs[0].output_token_ids
    assert s.queues.prefix_hit_tokens == 16 and s.queues.prefix_queried_tokens == 36


def test_prefix_caching_off_computes_everything() -> None:
    s = make_scheduler(num_blocks=32, prefix_caching=False)
    prompt = prompt_of(3, 18)
    make_group(s, prompt, 5, 0)
    drive(s)
    again = make_group(s, prompt, 5, 1)
    plans, _ = drive(s)
    assert plans[0].context_lens.tolist() == [0] and again.prefix_hit_tokens == 0


# ---- forks: n samples, best_of, beams ----


def test_n_samples_share_the_prompt_and_fork_before_its_last_token() -> None:
    s = make_scheduler(num_blocks=32)
    prompt = prompt_of(1, 6)  # blocks [0: 4 tokens][1: 2 tokens]
    group = make_group(s, prompt, 6, 0, n=3, best_of=3, temperature=1.0, seed=7)
    plans, events = drive(s)
    assert plans[0].query_lens.tolist() == [5] and plans[0].sample.tolist() == [0]
    fork = plans[1]
    assert fork.query_lens.tolist() == [1, 1, 1] and fork.context_lens.tolist() == [5, 5, 5]
    # The partly filled block 1 is shared by three writers: two copies, the last writes in place.
    assert fork.copy.tolist() == [[1, 2], [1, 3]]
    assert fork.block_tables.dense().tolist() == [[0, 2], [0, 3], [0, 1]]
    outs = [seq.output_token_ids for seq in group.seqs]
    assert len({tuple(o) for o in outs}) == 3  # distinct samples
    again = outputs_alone(prompt, 6, n=3, best_of=3, temperature=1.0, seed=7)
    assert outs == again  # reproducible from the seed
    assert [seq.index for seq in group.seqs] == [0, 1, 2]
    assert sum(e.group_finished for e in events) == 1


def test_best_of_returns_the_n_best_by_cumulative_logprob() -> None:
    s = make_scheduler(num_blocks=64)
    group = make_group(s, prompt_of(2, 5), 6, 0, n=2, best_of=4, temperature=1.0, seed=3)
    drive(s)
    assert len(group.seqs) == 4 and not group.streams
    best = group.best()
    ranked = sorted(group.seqs, key=lambda q: -q.cumulative_logprob)
    assert best == ranked[:2]


def test_beam_search_survives_preemption_with_identical_results() -> None:
    alone = make_scheduler(num_blocks=128)
    ref = make_group(alone, prompt_of(4, 7), 8, 0, beam_width=3, n=2)
    drive(alone)
    assert ref.beam is not None and len(ref.beam.pool) == 3
    for mode in ("swap", "recompute"):
        s = make_scheduler(num_blocks=16, num_cpu_blocks=64, preemption_mode=mode)
        others = [make_group(s, prompt_of(10 + i, 6), 12, i) for i in range(4)]
        beam = make_group(s, prompt_of(4, 7), 8, 9, beam_width=3, n=2)
        drive(s)
        assert beam.num_preemptions + sum(g.num_preemptions for g in others) > 0
        assert beam.beam is not None
        assert [h.output_token_ids for h in beam.beam.pool] == [h.output_token_ids for h in ref.beam.pool]
        assert [h.score for h in beam.beam.pool] == pytest.approx([h.score for h in ref.beam.pool])


def test_beam_hypotheses_are_ranked_by_length_penalised_score() -> None:
    s = make_scheduler(num_blocks=128)
    group = make_group(s, prompt_of(5, 5), 6, 0, beam_width=4, length_penalty=0.5)
    drive(s)
    assert group.beam is not None
    pool = group.beam.pool
    assert len(pool) == 4
    for hyp in pool:
        assert hyp.score == pytest.approx(hyp.cumulative_logprob / len(hyp.output_token_ids) ** 0.5)
        assert hyp.finish_reason is FinishReason.LENGTH and len(hyp.output_token_ids) == 6
    assert [h.score for h in pool] == sorted((h.score for h in pool), reverse=True)


def test_group_slots_count_against_max_num_seqs() -> None:
    s = make_scheduler(num_blocks=64, max_num_seqs=4)
    a = make_group(s, prompt_of(0, 3), 3, 0, n=3, best_of=3, temperature=1.0, seed=1)
    b = make_group(s, prompt_of(1, 3), 3, 1, n=2, best_of=2, temperature=1.0, seed=1)
    plan = s.schedule()
    assert plan is not None
    assert set(plan.seq_ids.tolist()) == {a.group_id}  # b's 2 slots would exceed 4
    s.update(plan, fake_execute(plan))
    drive(s)
    assert all(seq.num_output_tokens == 3 for seq in b.seqs)


@pytest.mark.parametrize("width", [{"best_of": 4, "n": 2, "temperature": 1.0, "seed": 5}, {"beam_width": 3}])
def test_a_forked_group_recomputed_under_pressure_comes_back_sharing_its_prompt(width: dict) -> None:
    # 30 blocks, no swap space: the forked group (4 x 40-token prompts would need 40+ blocks
    # unshared) must recompute the prompt once and share it again, or it never fits.
    alone = make_scheduler(num_blocks=128)
    ref = make_group(alone, prompt_of(0, 40), 8, 0, priority=1, **width)
    drive(alone)
    s = make_scheduler(num_blocks=30, num_cpu_blocks=0)
    group = make_group(s, prompt_of(0, 40), 8, 0, priority=1, **width)
    for _ in range(4):
        plan = s.schedule()
        assert plan is not None
        s.update(plan, fake_execute(plan))
    urgent = make_group(s, prompt_of(1, 56), 8, 1, priority=0)
    later = make_group(s, prompt_of(2, 8), 4, 2, priority=1)
    drive(s, max_steps=300)
    assert group.num_preemptions >= 1 and s.queues.num_recompute_preemptions >= 1
    assert urgent.is_finished and later.is_finished
    if group.beam is not None:
        assert ref.beam is not None
        assert [h.output_token_ids for h in group.beam.pool] == [h.output_token_ids for h in ref.beam.pool]
    else:
        assert [q.output_token_ids for q in group.seqs] == [q.output_token_ids for q in ref.seqs]


def test_a_group_that_preempts_itself_comes_back_in_a_later_step() -> None:
    s = make_scheduler(num_blocks=30, num_cpu_blocks=0)
    group = make_group(s, prompt_of(0, 40), 8, 0, best_of=4, n=4, temperature=1.0, seed=1)
    for _ in range(4):
        plan = s.schedule()
        assert plan is not None
        s.update(plan, fake_execute(plan))
    s.queues.preempt(group, s.next_step_id)  # as if the step had no room left for it
    plan = s.schedule()
    assert plan is not None and plan.num_seqs == 0  # the step ends; nothing waits forever
    s.update(plan, fake_execute(plan))
    drive(s)
    assert all(q.num_output_tokens == 8 for q in group.seqs)


def _scoring_worker(plan: StepPlan) -> StepResult:
    """fake_execute plus prompt log-probabilities from the worker's real scoring routine, over
    a fake model whose logits row for a position is [position, position + 1, ...]."""
    import torch

    from worker_svc.sampling.logprobs import prompt_logprobs

    result = fake_execute(plan)
    s = plan.sampling
    if not (s.prompt_logprobs.size and s.prompt_logprobs.max() >= 0):
        return result
    starts = np.concatenate([[0], np.cumsum(plan.query_lens)])
    positions = np.concatenate([np.arange(c, c + q) for c, q in zip(plan.context_lens, plan.query_lens)])
    hidden = torch.tensor(positions, dtype=torch.float32)[:, None]
    values = prompt_logprobs(
        lambda h: h * 0.01 * torch.arange(VOCAB, dtype=torch.float32)[None, :],
        hidden,
        starts,
        plan.input_ids,
        s.prompt_logprobs,
        s.prompt_next_token,
    )
    fields = ("prompt_offsets", "prompt_logprobs", "prompt_top_token_ids", "prompt_top_logprobs")
    return StepResult(result.step_id, result.sampled_token_ids, logprobs=result.logprobs, **dict(zip(fields, values)))


def _expected_prompt_scores(prompt: list[int]) -> list[tuple[int, float]]:
    import torch

    out = []
    for p in range(1, len(prompt)):
        row = torch.log_softmax((p - 1) * 0.01 * torch.arange(VOCAB, dtype=torch.float32), -1)
        out.append((prompt[p], float(row[prompt[p]])))
    return out


@pytest.mark.parametrize(
    ("prompt_len", "budget", "width"),
    [
        (17, 16, {}),  # the chunk boundary falls on the last prompt position
        (17, 2048, {"best_of": 2, "n": 2, "temperature": 1.0, "seed": 3}),  # a sibling re-forks at P-1
        (100, 32, {}),  # recomputed with other chunk boundaries than the first pass
    ],
)
def test_prompt_scores_survive_recompute_and_forks_exactly_once(prompt_len: int, budget: int, width: dict) -> None:
    s = make_scheduler(num_blocks=256, preemption_mode="recompute", max_num_batched_tokens=budget)
    # A neighbour shares the token budget, so the scored request's first chunks are uneven.
    make_group(s, prompt_of(7, 9), 2, 0)
    group = make_group(s, prompt_of(1, prompt_len), 6, 1, prompt_logprobs=1, **width)
    for _ in range(3):
        plan = s.schedule()
        assert plan is not None
        s.update(plan, _scoring_worker(plan))
    s.queues.preempt(group, s.next_step_id)
    while (plan := s.schedule()) is not None:
        s.update(plan, _scoring_worker(plan))
        s.check_integrity()
    got = [(t, lp) for t, lp, _ in group.prompt_logprobs]
    want = _expected_prompt_scores(group.seqs[0].prompt_token_ids)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert [lp for _, lp in got] == pytest.approx([lp for _, lp in want], abs=1e-5)
