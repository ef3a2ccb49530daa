"""Several worker groups in one engine: routing, and moving a lost group's requests.

Pure parts (Scheduler.evacuate, Router) run against the position-keyed fake worker of
test_scheduler, whose token at a position is fixed, so a request continued elsewhere must
produce exactly the tokens it would have produced undisturbed. The engine parts use the
scripted fake worker of test_engine; real worker processes are in test_scale_out.py.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest

from common.config import SchedulerConfig
from common.errors import Aborted, Unavailable
from common.model_spec import ModelSpec
from common.plan import StepPlan, StepResult
from common.worker_info import WorkerInfo
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.engine import Engine
from scheduler_svc.replica import Replica
from scheduler_svc.request import GenerationRequest, RequestOutput
from scheduler_svc.router import Router
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus, StoppingParams
from scheduler_svc.sequence_group import SequenceGroup
from scheduler_svc.tokenizer import Tokenizer
from scheduler_svc.worker_client import StepTiming, WorkerLost
from tests.test_engine import FakeWorker, spec, tokenizer  # noqa: F401 (fixtures)
from tests.test_scheduler import EOS, expected_output, fake_execute

# ---- Scheduler.evacuate ----


def scheduler(ids: itertools.count[int], num_blocks: int = 64, num_cpu_blocks: int = 0, **cfg: object) -> Scheduler:
    bm = BlockManager(num_blocks, 4, num_cpu_blocks=num_cpu_blocks, enable_prefix_caching=True)
    return Scheduler(SchedulerConfig(**cfg), bm, 1024, frozenset({EOS}), block_bytes=1000, seq_ids=ids)  # type: ignore[arg-type]


def group(
    ids: itertools.count[int], prompt_len: int, max_tokens: int, arrival: int, n: int = 1, prompt: list[int] | None = None
) -> SequenceGroup:
    seq_id = next(ids)
    seq = Sequence(
        seq_id=seq_id, request_id=f"r{seq_id}", prompt_token_ids=prompt or [100 + 50 * seq_id + i for i in range(prompt_len)],
        sampling=SamplingParams(n=n, best_of=n, seed=7), stopping=StoppingParams(max_tokens=max_tokens), arrival=arrival,
    )
    return SequenceGroup(seq.request_id, [seq], seq.sampling, arrival)


def test_evacuated_groups_finish_elsewhere_with_the_tokens_they_would_have_had() -> None:
    ids = itertools.count()
    # A small pool with a host pool and forced swapping: some groups are swapped out when lost.
    lost = scheduler(ids, num_blocks=14, num_cpu_blocks=32, preemption_mode="swap")
    groups = [group(ids, 6, 12, 0, n=2)] + [group(ids, 9 + i, 12, 1 + i) for i in range(5)]
    for g in groups:
        lost.add(g)
    for _ in range(8):
        plan = lost.schedule()
        assert plan is not None
        lost.update(plan, fake_execute(plan))
    pair = groups[0]
    assert pair.forked and len(pair.seqs) == 2
    stopped = pair.seqs[1]
    lost.finish_seq(stopped.seq_id, FinishReason.STOP_SEQUENCE)
    kept = list(stopped.token_ids)
    assert lost.num_swapped > 0 and lost.num_running > 0  # every queue is represented
    plan = lost.schedule()  # a step in flight when the worker group is lost
    assert plan is not None

    moved = lost.evacuate()
    assert [g.key for g in moved] == sorted(g.key for g in groups)
    assert not lost.has_work
    assert lost.block_manager.num_free_blocks == 14 and lost.block_manager.cpu.num_free == 32
    lost.check_integrity()
    for g in moved:
        assert g.status is SequenceStatus.WAITING
        assert all(s.num_computed_tokens == 0 and s.status is SequenceStatus.WAITING for s in g.live())
    assert stopped.is_finished and stopped.finish_reason is FinishReason.STOP_SEQUENCE

    other = scheduler(ids)
    for g in moved:
        other.add(g)
    while (plan := other.schedule()) is not None:
        other.update(plan, fake_execute(plan))
        other.check_integrity()
    assert other.block_manager.num_free_blocks == other.block_manager.num_blocks
    for g in groups:
        for s in g.seqs:
            if s is stopped:
                assert s.token_ids == kept  # a finished sample is not revived
            else:
                assert s.output_token_ids == expected_output(s.num_prompt_tokens, 12), s.seq_id


# ---- Router ----


def replica(name: str, num_blocks: int = 64) -> Replica:
    r = Replica(name, FakeWorker.__new__(FakeWorker))
    r.scheduler = scheduler(itertools.count(1000 * ord(name[0])), num_blocks=num_blocks)
    return r


def test_a_burst_spreads_over_equal_groups_by_queued_demand() -> None:
    router, ids = Router(enable_prefix_caching=True), itertools.count()
    a, b = replica("a"), replica("b")
    for i in range(6):
        g = group(ids, 8, 4, i)
        target = router.pick([a, b], g.seqs[0].token_ids)
        assert target is not None
        target.post(g)
    assert (a.num_queued, b.num_queued) == (3, 3)


def test_a_prompt_follows_its_cached_prefix_until_load_outweighs_it() -> None:
    router, ids = Router(enable_prefix_caching=True), itertools.count()
    a, b = replica("a"), replica("b")
    system = [7] * 40  # 10 full blocks of 4 tokens shared by the prompts below
    warm = group(ids, 0, 2, 0, prompt=system + [1, 2])
    b.scheduler.add(warm)  # type: ignore[union-attr]
    while (plan := b.scheduler.schedule()) is not None:  # type: ignore[union-attr]
        b.scheduler.update(plan, fake_execute(plan))  # type: ignore[union-attr]
    prompt = system + [3, 4, 5]
    assert not b.scheduler.has_work and b.scheduler.block_manager.num_used_blocks == 0  # type: ignore[union-attr]
    assert router.pick([a, b], prompt) is b
    # Without prefix caching the groups are equal and the first one wins the tie.
    assert Router(enable_prefix_caching=False).pick([a, b], prompt) is a
    # Queue 12 blocks of demand on b: more than its 10-block hit is worth.
    for i in range(2):
        g = group(ids, 22, 4, 10 + i)
        b.post(g)
    assert router.pick([a, b], prompt) is a


# ---- the engine with two fake worker groups ----


class LosingWorker(FakeWorker):
    """Loses its link (as a killed process would) at a step, and cannot be reached after."""

    def __init__(self, spec: ModelSpec, script: list[int], address: str, lose_at_step: int | None = None) -> None:
        super().__init__(spec, script)
        self.address = address
        self.lose_at_step = lose_at_step
        self.gone = False
        self.delay = 0.002

    async def connect(self, timeout: float) -> WorkerInfo:
        if self.gone:
            await asyncio.sleep(0.05)
            raise WorkerLost(f"{self.address} is gone")
        return await super().connect(timeout)

    async def execute(self, plan: StepPlan) -> tuple[StepResult, StepTiming]:
        if self.lose_at_step is not None and self.steps + 1 >= self.lose_at_step:
            self.gone = True
            raise WorkerLost(f"{self.address} broke its stream")
        return await super().execute(plan)


async def two_groups(spec: ModelSpec, tokenizer: Tokenizer, a: FakeWorker, b: FakeWorker) -> Engine:
    engine = Engine(spec, tokenizer, SchedulerConfig(), [a, b])  # type: ignore[list-item]
    engine.start()
    for _ in range(200):
        if len(engine.replicas) == 2:
            return engine
        await asyncio.sleep(0.01)
    raise TimeoutError("both groups never became ready")


async def generate(engine: Engine, i: int, max_tokens: int) -> list[int]:
    req = GenerationRequest(request_id=f"q{i}", prompt_token_ids=(5, 6, i), max_tokens=max_tokens, ignore_eos=True)
    outs: list[RequestOutput] = [o async for o in engine.generate(req)]
    return [t for o in outs for t in o.token_ids]


async def test_a_lost_groups_requests_finish_on_the_other_without_a_gap_or_a_repeat(
    spec: ModelSpec, tokenizer: Tokenizer  # noqa: F811
) -> None:
    script = list(range(300, 340))
    a, b = LosingWorker(spec, script, "a", lose_at_step=6), LosingWorker(spec, script, "b")
    engine = await two_groups(spec, tokenizer, a, b)
    try:
        results = await asyncio.gather(*(generate(engine, i, 20) for i in range(8)))
        assert all(tokens == script[:20] for tokens in results)
        assert a.gone and engine.metrics.recovered._value.get() >= 1  # noqa: SLF001
        assert [r.name for r in engine.replicas] == ["b"]
        sched = engine.replicas[0].scheduler
        assert sched is not None and not sched.has_work and sched.block_manager.num_used_blocks == 0
    finally:
        await engine.stop()


async def test_with_every_group_lost_requests_fail_by_what_they_streamed(
    spec: ModelSpec, tokenizer: Tokenizer  # noqa: F811
) -> None:
    script = list(range(300, 340))
    a, b = LosingWorker(spec, script, "a", lose_at_step=4), LosingWorker(spec, script, "b", lose_at_step=4)
    engine = await two_groups(spec, tokenizer, a, b)
    try:
        # max_num_seqs is 256, so all run; the last one arrives after both groups are gone.
        results = await asyncio.gather(*(generate(engine, i, 20) for i in range(4)), return_exceptions=True)
        assert all(isinstance(r, Aborted) for r in results), results
        with pytest.raises(Unavailable, match="no ready worker"):
            await generate(engine, 9, 4)
        assert not engine.ready and not engine._streams  # noqa: SLF001
    finally:
        await engine.stop()
