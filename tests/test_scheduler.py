"""The pure scheduler, driven by a fake stateless worker.

The fake worker's token at a position depends only on that position, the way a real model's
greedy token depends only on the tokens before it: a sequence must then produce the same
output whether it ran alone, in a batch, or was preempted and recomputed.
"""

from __future__ import annotations

import numpy as np
import pytest

from common.config import SchedulerConfig
from common.plan import StepPlan, StepResult
from scheduler_svc.kv.block_manager import BlockManager
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.sequence import FinishReason, SamplingOptions, Sequence, SequenceStatus, StoppingParams
from scheduler_svc.sched.sequence_group import SequenceGroup

EOS = 2


def fake_token(position: int) -> int:
    return 10 + (position * 7) % 1000


def fake_execute(plan: StepPlan) -> StepResult:
    ends = plan.context_lens + plan.query_lens  # position of the next token
    tokens = np.where(plan.sample == 1, [fake_token(int(e)) for e in ends], -1).astype(np.int32)
    return StepResult(plan.step_id, tokens)


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_model_len: int = 1024,
    num_cpu_blocks: int = 0,
    prefix_caching: bool = True,
    block_bytes: int = 1000,
    **cfg: object,
) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, num_host_blocks=num_cpu_blocks, enable_prefix_caching=prefix_caching)
    return Scheduler(SchedulerConfig(**cfg), bm, max_model_len, frozenset({EOS}), block_bytes=block_bytes)  # type: ignore[arg-type]


def make_seq(seq_id: int, prompt_len: int, max_tokens: int | None = 4, **stopping: object) -> Sequence:
    return Sequence(
        seq_id=seq_id,
        request_id=f"r{seq_id}",
        prompt_token_ids=[100 + seq_id * 1000 + i for i in range(prompt_len)],
        sampling=SamplingOptions(),
        stopping=StoppingParams(max_tokens=max_tokens, **stopping),  # type: ignore[arg-type]
        arrival=seq_id,
    )


def add(s: Scheduler, seq: Sequence, priority: int = 0) -> SequenceGroup:
    group = SequenceGroup.of(seq, priority)
    s.add(group)
    return group


def drive(s: Scheduler, max_steps: int = 10_000) -> list[StepPlan]:
    plans = []
    for _ in range(max_steps):
        plan = s.schedule()
        if plan is None:
            break
        s.update(plan, fake_execute(plan))
        s.check_integrity()
        plans.append(plan)
    assert not s.has_work
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks
    return plans


def expected_output(prompt_len: int, n: int) -> list[int]:
    return [fake_token(prompt_len + i) for i in range(n)]


def test_prefill_then_decode_feeds_the_sampled_token() -> None:
    s = make_scheduler()
    seq = make_seq(0, prompt_len=6, max_tokens=3)
    add(s, seq)
    p0 = s.schedule()
    assert p0 is not None
    assert p0.query_lens.tolist() == [6] and p0.context_lens.tolist() == [0] and p0.sample.tolist() == [1]
    assert p0.input_ids.tolist() == seq.prompt_token_ids
    assert p0.block_tables.dense().tolist() == [[0, 1]]
    s.update(p0, fake_execute(p0))
    p1 = s.schedule()
    assert p1 is not None
    assert p1.query_lens.tolist() == [1] and p1.context_lens.tolist() == [6]
    assert p1.input_ids.tolist() == [fake_token(6)]
    assert p1.sampling.output_position.tolist() == [1]
    s.update(p1, fake_execute(p1))
    drive(s)
    assert seq.output_token_ids == expected_output(6, 3)
    assert seq.finish_reason is FinishReason.LENGTH


def test_long_prompt_is_chunked_under_the_token_budget() -> None:
    s = make_scheduler(max_num_batched_tokens=8)
    seq = make_seq(0, prompt_len=20, max_tokens=2)
    add(s, seq)
    plans = drive(s)
    assert [p.query_lens.tolist() for p in plans] == [[8], [8], [4], [1]]
    assert [p.context_lens.tolist() for p in plans] == [[0], [8], [16], [20]]
    assert [p.sample.tolist() for p in plans] == [[0], [0], [1], [1]]
    assert seq.output_token_ids == expected_output(20, 2)


def test_decodes_and_a_new_prefill_share_a_step_running_first() -> None:
    s = make_scheduler(max_num_batched_tokens=10)
    a = make_seq(0, prompt_len=5, max_tokens=5)
    add(s, a)
    p = s.schedule()
    assert p is not None
    s.update(p, fake_execute(p))
    b = make_seq(1, prompt_len=12, max_tokens=2)
    add(s, b)
    mixed = s.schedule()
    assert mixed is not None
    assert mixed.seq_ids.tolist() == [0, 1]
    assert mixed.query_lens.tolist() == [1, 9]  # decode of a, then the first 9 of b's 12 tokens
    assert mixed.sample.tolist() == [1, 0]
    s.update(mixed, fake_execute(mixed))
    drive(s)
    assert a.output_token_ids == expected_output(5, 5)
    assert b.output_token_ids == expected_output(12, 2)


def test_a_prompt_prefilled_in_chunks_never_holds_back_a_decode() -> None:
    """A long prompt ahead of running decodes in line (a higher priority) takes only what
    budget they leave: every step of its prefill still carries a token of each decode."""
    s = make_scheduler(max_num_batched_tokens=8, num_blocks=256)
    a, b = make_seq(0, prompt_len=3, max_tokens=30), make_seq(1, prompt_len=3, max_tokens=30)
    add(s, a)
    add(s, b)
    p = s.schedule()
    assert p is not None
    s.update(p, fake_execute(p))
    long = make_seq(2, prompt_len=60, max_tokens=2)
    add(s, long, priority=-1)
    assert s.queues.waiting[0].seqs[0] is long
    chunked = 0
    while long.num_computed_tokens < 60:
        plan = s.schedule()
        assert plan is not None
        ids, q = plan.seq_ids.tolist(), plan.query_lens.tolist()
        assert ids[:2] == [0, 1] and q[:2] == [1, 1], (ids, q)  # both decodes, first
        if 2 in ids:
            chunked += 1
            assert q[ids.index(2)] <= 6
        s.update(plan, fake_execute(plan))
        s.block_manager.check_integrity()
    assert chunked >= 10
    drive(s)
    assert a.output_token_ids == expected_output(3, 30) and long.output_token_ids == expected_output(60, 2)


def test_max_num_seqs_limits_admission() -> None:
    s = make_scheduler(max_num_seqs=2)
    for i in range(3):
        add(s, make_seq(i, prompt_len=3, max_tokens=2))
    p = s.schedule()
    assert p is not None and p.seq_ids.tolist() == [0, 1]
    assert s.num_waiting == 1
    s.update(p, fake_execute(p))
    drive(s)


def test_preemption_by_recompute_keeps_every_token_and_frees_everything() -> None:
    # 6 blocks of 4 tokens; each sequence grows to 4 + 8 = 12 tokens = 3 blocks, so three
    # sequences cannot all hold their KV at once.
    s = make_scheduler(num_blocks=6, block_size=4)
    seqs = [make_seq(i, prompt_len=4, max_tokens=8) for i in range(3)]
    for seq in seqs:
        add(s, seq)
    drive(s)
    assert s.queues.num_preemptions > 0
    assert seqs[0].num_preemptions == 0  # the oldest is never the victim while a later one runs
    assert sum(seq.num_preemptions for seq in seqs[1:]) == s.queues.num_preemptions
    for seq in seqs:
        assert seq.output_token_ids == expected_output(4, 8)
        assert seq.finish_reason is FinishReason.LENGTH


def test_preempted_sequence_recomputes_prompt_and_output_then_continues() -> None:
    s = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64, prefix_caching=False)
    a = make_seq(0, prompt_len=4, max_tokens=8)
    b = make_seq(1, prompt_len=4, max_tokens=8)
    add(s, a)
    add(s, b)
    plans = drive(s)
    recompute = [p for p in plans if 1 in p.seq_ids.tolist() and p.context_lens[p.seq_ids.tolist().index(1)] == 0]
    assert len(recompute) == 2  # the first prefill, and the re-prefill after preemption
    again = recompute[1]
    row = again.seq_ids.tolist().index(1)
    assert again.query_lens[row] > 4  # prompt plus the outputs generated before preemption
    assert b.output_token_ids == expected_output(4, 8)


def test_finish_reasons() -> None:
    s = make_scheduler(max_model_len=12)
    length = make_seq(0, prompt_len=3, max_tokens=2)
    stop_id = make_seq(1, prompt_len=3, max_tokens=10, stop_token_ids=frozenset({fake_token(4)}))
    context = make_seq(2, prompt_len=8, max_tokens=None)
    for seq in (length, stop_id, context):
        add(s, seq)
    drive(s)
    assert length.finish_reason is FinishReason.LENGTH and length.num_output_tokens == 2
    assert stop_id.finish_reason is FinishReason.STOP and stop_id.output_token_ids[-1] == fake_token(4)
    assert context.finish_reason is FinishReason.CONTEXT_LENGTH and context.num_tokens == 12


def test_eos_stops_unless_ignored() -> None:
    def eos_at_5(plan: StepPlan) -> StepResult:
        return StepResult(plan.step_id, np.where(plan.sample == 1, EOS, -1).astype(np.int32))

    for ignore, expected in ((False, FinishReason.STOP), (True, FinishReason.LENGTH)):
        s = make_scheduler()
        seq = make_seq(0, prompt_len=3, max_tokens=3, ignore_eos=ignore)
        add(s, seq)
        while (plan := s.schedule()) is not None:
            s.update(plan, eos_at_5(plan))
        assert seq.finish_reason is expected
        assert s.block_manager.num_free_blocks == s.block_manager.num_blocks


def test_abort_frees_running_and_waiting_sequences() -> None:
    s = make_scheduler(max_num_seqs=1)
    a, b = make_seq(0, 6, max_tokens=100), make_seq(1, 6, max_tokens=100)
    add(s, a)
    add(s, b)
    plan = s.schedule()
    assert plan is not None
    s.update(plan, fake_execute(plan))
    assert s.block_manager.num_used_blocks == 2
    group_a, group_b = s.queues.group_of(a), s.queues.group_of(b)
    assert s.abort(0) is group_a and a.status is SequenceStatus.FINISHED and a.finish_reason is FinishReason.ABORTED
    assert s.abort(1) is group_b
    assert s.abort(1) is None
    assert not s.has_work and s.block_manager.num_free_blocks == s.block_manager.num_blocks
    s.check_integrity()


def test_step_protocol_is_enforced() -> None:
    s = make_scheduler()
    add(s, make_seq(0, 3))
    plan = s.schedule()
    assert plan is not None
    ahead = s.schedule()  # planned ahead of the first plan's result (tests/test_plan_ahead.py)
    assert ahead is not None and ahead.step_id == plan.step_id + 1
    assert s.schedule() is None  # two in flight: no third
    with pytest.raises(RuntimeError):
        s.update(ahead, StepResult(ahead.step_id, np.zeros(1, np.int32)))  # results come in plan order
    with pytest.raises(RuntimeError):
        s.update(plan, StepResult(plan.step_id + 1, np.zeros(1, np.int32)))
    s.update(plan, fake_execute(plan))
    with pytest.raises(ValueError):
        add(s, make_seq(0, 3))  # id 0 still running


def test_watermark_holds_back_admission_only_while_others_run() -> None:
    s = make_scheduler(num_blocks=10, block_size=4, watermark=0.2)  # keep 2 blocks in reserve
    big = make_seq(0, prompt_len=40, max_tokens=1)  # all 10 blocks: admitted, nothing else runs
    add(s, big)
    assert drive(s)[0].seq_ids.tolist() == [0]
    a = make_seq(1, prompt_len=12, max_tokens=3)  # 3 blocks, then 4
    b = make_seq(2, prompt_len=24, max_tokens=1)  # 6 blocks: 6 + 2 reserve > 7 free while a runs
    add(s, a)
    add(s, b)
    plans = drive(s)
    first_b = next(i for i, p in enumerate(plans) if 2 in p.seq_ids.tolist())
    assert all(p.seq_ids.tolist() == [1] for p in plans[:first_b])
    assert a.finish_reason is FinishReason.LENGTH and a.num_output_tokens == 3
    assert plans[first_b].seq_ids.tolist() == [2]  # admitted once a had finished


def test_can_ever_fit() -> None:
    s = make_scheduler(num_blocks=4, block_size=4)
    assert s.can_ever_fit(4, 16)
    assert not s.can_ever_fit(4, 17)
    # Two samples of an 8-token prompt share its first block only: each writes the last prompt
    # token (block 1) after the fork, then its own block 2.
    assert not s.can_ever_fit(8, 12, width=2)
    assert make_scheduler(num_blocks=5, block_size=4).can_ever_fit(8, 12, width=2)
    assert s.can_ever_fit(9, 12, width=2)  # blocks 0 and 1 shared, block 2 each
