"""Micro-batches: a pipelined worker group keeps one plan in flight per stage, over disjoint
sequences (Scheduler with pipeline_stages > 1), against the same workload run one plan at a
time.

The fake pipeline runs plans in the order they were made, as every stage does; its token
depends on the last fed token and the position, so a token applied twice, a step skipped or a
sequence fed from a stale state changes every later token of that sequence. Around it the
test checks what the design promises: no sequence in two plans at once, no preemption of a
group whose plan is in flight, no deferred input, and every block back in the pool.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

import numpy as np
import pytest

from common.config import MAX_MICROBATCHES, SchedulerConfig
from common.plan import DEFERRED_INPUT, StepPlan, StepResult
from scheduler_svc.kv.block_manager import BlockManager
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.sequence import FinishReason
from scheduler_svc.sched.sequence_group import SequenceGroup
from tests.test_plan_ahead import EOS, _group, _token, _workload, arrive_and_abort


class InOrderPipeline:
    """Runs plans in the order they were sent; nothing is carried between them."""

    def execute(self, plan: StepPlan) -> StepResult:
        assert not (plan.input_ids == DEFERRED_INPUT).any(), "a pipeline's plan names a token in flight"
        ends = np.cumsum(plan.query_lens)
        tokens = np.full(plan.num_seqs, -1, np.int32)
        for i in range(plan.num_seqs):
            if plan.sample[i]:
                fed = int(plan.input_ids[ends[i] - 1])
                tokens[i] = _token(fed, int(plan.context_lens[i] + plan.query_lens[i]))
        return StepResult(plan.step_id, tokens, logprobs=np.zeros(plan.num_seqs, np.float32))


def _scheduler(
    num_blocks: int, stages: int, micro_batches: int = 0, share_cores: bool = False, **cfg: object
) -> Scheduler:
    bm = BlockManager(num_blocks, 4, num_host_blocks=16, enable_prefix_caching=True)
    config = SchedulerConfig(pipeline_microbatches=micro_batches, **cfg)  # type: ignore[arg-type]
    return Scheduler(
        config, bm, 256, frozenset({EOS}), block_bytes=1000, pipeline_stages=stages, stages_share_cores=share_cores
    )


def _busy(in_flight: deque[tuple[StepPlan, frozenset[int]]]) -> set[int]:
    return {g for _, groups in in_flight for g in groups}


def _run(
    workload: list[dict], stages: int, micro_batches: int, num_blocks: int, **cfg: object
) -> tuple[dict[str, list[list[int]]], int]:
    """Outputs by request, and the most plans that were in flight at once."""
    s = _scheduler(num_blocks, stages, micro_batches, **cfg)
    in_flight: deque[tuple[StepPlan, frozenset[int]]] = deque()  # plans sent, and their groups
    preempt = s.queues.preempt

    def preempt_idle_groups_only(group: SequenceGroup, step_id: int) -> object:
        assert group.group_id not in _busy(in_flight), "a group preempted while its plan is in flight"
        return preempt(group, step_id)

    s.queues.preempt = preempt_idle_groups_only  # type: ignore[method-assign,assignment]
    worker = InOrderPipeline()
    groups: list[SequenceGroup] = []
    step = most = 0
    pending = sorted(workload, key=lambda w: w["at"])
    while pending or s.has_work or in_flight:
        arrive_and_abort(s, step, pending, workload, groups)
        while len(in_flight) < s.max_in_flight:
            plan = s.schedule() if s.has_work else None
            if plan is None:
                break
            planned = frozenset(s.queues.seqs[i].group_id for i in plan.seq_ids.tolist() if i in s.queues.seqs)
            assert not planned & _busy(in_flight), "a group in two plans at once"
            in_flight.append((plan, planned))
        most = max(most, len(in_flight))
        step += 1
        assert step < 20_000, "the scheduler stopped making progress"
        if not in_flight:
            continue
        plan, _ = in_flight.popleft()
        for event in s.update(plan, worker.execute(plan)):
            if event.finish_reason is None and event.token_id == 5 and event.seq.request_id.endswith("7"):
                s.finish_seq(event.seq.seq_id, FinishReason.STOP_SEQUENCE)
        s.check_integrity()
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks
    return {g.request_id: [seq.output_token_ids for seq in g.seqs] for g in groups}, most


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize(("stages", "num_blocks", "budget"), [(2, 200, 48), (2, 40, 48), (3, 24, 8), (4, 60, 16)])
def test_micro_batches_change_no_output(seed: int, stages: int, num_blocks: int, budget: int) -> None:
    # Small pools: preemption by swap and recompute happens while other plans are in flight.
    workload = _workload(seed, n=30 if budget == 8 else 24)
    cfg = {"max_num_batched_tokens": budget, "max_num_seqs": 8}
    aborted = {f"r{w['rid']}" for w in workload if w.get("abort_at") is not None}
    want, one = _run([dict(w) for w in workload], stages, 1, num_blocks, **cfg)
    got, most = _run([dict(w) for w in workload], stages, 0, num_blocks, **cfg)
    assert one == 1 and most == stages + 1  # one per stage, and one for the scheduler's turn-around
    assert {r: o for r, o in got.items() if r not in aborted} == {r: o for r, o in want.items() if r not in aborted}
    # An abort at a fixed step catches another number of tokens: each is a prefix of the full output.
    full, _ = _run([{k: v for k, v in w.items() if k != "abort_at"} for w in workload], stages, 1, num_blocks, **cfg)
    for r in aborted:
        assert all(f[: len(g)] == g for g, f in zip(got[r], full[r])), r


def test_decodes_split_evenly_over_the_micro_batches() -> None:
    s = _scheduler(200, stages=2, micro_batches=2)
    groups = [_group(s, r, [20 + r] * 5, max_tokens=30) for r in range(8)]
    worker = InOrderPipeline()
    first = s.schedule()
    # Admission is bounded by the token budget only: the first plan takes every prompt, and
    # the second finds nothing idle.
    assert first is not None and first.num_seqs == 8 and s.schedule() is None
    s.update(first, worker.execute(first))
    # Then each plan takes its share of the idle running sequences: half, and the other half.
    in_flight = deque([s.schedule(), s.schedule()])
    assert [p.num_seqs if p is not None else 0 for p in in_flight] == [4, 4]
    sizes = []
    for _ in range(20):
        plan = in_flight.popleft()
        s.update(plan, worker.execute(plan))
        nxt = s.schedule()
        assert nxt is not None
        in_flight.append(nxt)
        sizes.append(nxt.num_seqs)
        assert s.schedule() is None  # two stages: two plans in flight at most
    assert sizes[-10:] == [4] * 10
    assert all(g.seqs[0].pending == 0 for g in groups)


def test_a_plan_takes_only_the_groups_no_plan_in_flight_holds() -> None:
    s = _scheduler(200, stages=2)
    a = _group(s, 1, [30, 31, 32], max_tokens=9)
    first = s.schedule()
    assert first is not None and first.seq_ids.tolist() == [a.seqs[0].seq_id]
    assert s.schedule() is None  # the only group is in flight: nothing to plan
    b = _group(s, 2, [40, 41], max_tokens=9)
    second = s.schedule()
    assert second is not None and second.seq_ids.tolist() == [b.seqs[0].seq_id]
    assert s.schedule() is None and s.max_in_flight == 3  # two stages and one more
    s.update(first, InOrderPipeline().execute(first))
    third = s.schedule()
    assert third is not None and third.seq_ids.tolist() == [a.seqs[0].seq_id]
    assert third.context_lens.tolist() == [3] and third.input_ids.tolist() != [DEFERRED_INPUT]


def test_the_victim_of_a_preemption_is_never_in_flight() -> None:
    # Two groups whose prompts fill their blocks; the pool has no block to spare. The first
    # group's next token needs a block; the victim (last in line) is in flight: it waits.
    s = _scheduler(8, stages=2, micro_batches=2, max_num_batched_tokens=64)
    a = _group(s, 1, [40] * 16, max_tokens=9)
    first = s.schedule()
    assert first is not None and first.num_seqs == 1
    b = _group(s, 2, [50] * 16, max_tokens=9)
    second = s.schedule()
    assert second is not None and second.seq_ids.tolist() == [b.seqs[0].seq_id]
    assert s.block_manager.num_free_blocks == 0
    worker = InOrderPipeline()
    s.update(first, worker.execute(first))
    assert s.schedule() is None  # a needs a block; only b could give one, and b is in flight
    assert s.queues.num_preemptions == 0
    s.update(second, worker.execute(second))
    third = s.schedule()  # b is idle now: it gives its blocks back to a, first in line
    assert third is not None and third.seq_ids.tolist() == [a.seqs[0].seq_id]
    assert s.queues.num_preemptions == 1 and b.seqs[0].seq_id not in third.seq_ids.tolist()
    s.check_integrity()


def test_micro_batches_follow_the_stages_and_the_config() -> None:
    assert _scheduler(50, stages=1).max_in_flight == 2  # no pipeline: one plan ahead
    assert _scheduler(50, stages=1, plan_ahead=False).max_in_flight == 1
    assert _scheduler(50, stages=3).max_in_flight == 4  # one per stage, and one more
    assert _scheduler(50, stages=3, micro_batches=1).max_in_flight == 1  # a pipeline never plans ahead
    assert _scheduler(50, stages=2, micro_batches=2).max_in_flight == 2
    assert _scheduler(50, stages=16).max_in_flight == MAX_MICROBATCHES
    # Stages that are one CPU's ranks share its cores: one plan at a time unless asked.
    assert _scheduler(50, stages=2, share_cores=True).max_in_flight == 1
    assert _scheduler(50, stages=2, micro_batches=3, share_cores=True).max_in_flight == 3
    with pytest.raises(ValueError, match="pipeline_microbatches"):
        SchedulerConfig(pipeline_microbatches=MAX_MICROBATCHES + 1)


def test_the_flag_reaches_the_config_of_up_scheduler_and_the_offline_llm(tiny_model_dir: Path) -> None:
    from llmserve.cli import configs
    from llmserve.cli.parser import build_parser
    from llmserve.engine_args import engine_args

    up = build_parser().parse_args(["up", "--model", "/models/m", "--pp", "2", "--pp-microbatches", "2"])
    assert configs.scheduler_config(up).pipeline_microbatches == 2
    sched = build_parser().parse_args(["scheduler", "--model", "/models/m", "--worker", "a:1,b:2"])
    assert configs.scheduler_config(sched).pipeline_microbatches == 0  # one per stage and one more
    offline = engine_args(str(tiny_model_dir), "warning", {"pp": 2, "pp_microbatches": 4})
    assert offline.scheduler.pipeline_microbatches == 4
    with pytest.raises(ValueError, match="pipeline_microbatches"):
        configs.scheduler_config(build_parser().parse_args(["up", "--model", "/m", "--pp-microbatches", "9"]))
