"""Several worker groups in one engine: routing, and moving a lost group's requests.

Pure parts (Scheduler.evacuate, Router) run against the position-keyed fake worker of
test_scheduler, whose token at a position is fixed, so a request continued elsewhere must
produce exactly the tokens it would have produced undisturbed. The engine parts use the
scripted fake worker of test_engine; real worker processes are in test_scale_out.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Callable

import pytest

from common.config import SchedulerConfig
from common.errors import Aborted, Cancelled, Unavailable
from common.model_spec import ModelSpec
from common.plan import StepPlan, StepResult
from common.worker_info import WorkerInfo
from scheduler_svc.engine.engine import Engine
from scheduler_svc.engine.group_speed import MIN_STEPS, GroupSpeed
from scheduler_svc.engine.replica import Replica
from scheduler_svc.engine.request import GenerationRequest, RequestOutput
from scheduler_svc.engine.router import Router
from scheduler_svc.kv.block_manager import BlockManager
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.sequence import FinishReason, SamplingOptions, Sequence, SequenceStatus, StoppingParams
from scheduler_svc.sched.sequence_group import SequenceGroup
from scheduler_svc.text.tokenizer import Tokenizer
from scheduler_svc.workers.worker_client import StepTiming, WorkerLost
from tests.test_engine import FakeWorker, spec, tokenizer  # noqa: F401 (fixtures)
from tests.test_scheduler import EOS, expected_output, fake_execute
from tests.test_scheduler_memory import fake_execute as memory_fake_execute

# ---- Scheduler.evacuate ----


def scheduler(ids: itertools.count[int], num_blocks: int = 64, num_cpu_blocks: int = 0, **cfg: object) -> Scheduler:
    bm = BlockManager(num_blocks, 4, num_host_blocks=num_cpu_blocks, enable_prefix_caching=True)
    return Scheduler(SchedulerConfig(**cfg), bm, 1024, frozenset({EOS}), block_bytes=1000, seq_ids=ids)  # type: ignore[arg-type]


def group(
    ids: itertools.count[int],
    prompt_len: int,
    max_tokens: int,
    arrival: int,
    n: int = 1,
    prompt: list[int] | None = None,
) -> SequenceGroup:
    seq_id = next(ids)
    seq = Sequence(
        seq_id=seq_id,
        request_id=f"r{seq_id}",
        prompt_token_ids=prompt or [100 + 50 * seq_id + i for i in range(prompt_len)],
        sampling=SamplingOptions(n=n, best_of=n, seed=7),
        stopping=StoppingParams(max_tokens=max_tokens),
        arrival=arrival,
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
    assert lost.block_manager.num_free_blocks == 14 and lost.block_manager.host.num_free == 32
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


@pytest.mark.parametrize("prompt_len", [7, 8])
@pytest.mark.parametrize("shape", [{"n": 2, "best_of": 2, "temperature": 1.0, "seed": 5}, {"beam_width": 2}])
def test_a_group_admitted_as_fitting_finishes_on_a_pool_of_just_that_size(
    prompt_len: int, shape: dict[str, object]
) -> None:
    # Moved halfway, it is recomputed: its sequences then share only the prompt blocks before
    # the last prompt token. Both runs must fit the pool can_ever_fit promised.
    ids = itertools.count()
    need = scheduler(ids).blocks_for_group(prompt_len, prompt_len + 12, 2)
    lost, other = scheduler(ids, num_blocks=need), scheduler(ids, num_blocks=need)
    params = SamplingOptions(**shape)  # type: ignore[arg-type]
    seq = Sequence(
        next(ids), "r", list(range(10, 10 + prompt_len)), params, StoppingParams(max_tokens=12, ignore_eos=True), 0
    )
    moving = SequenceGroup("r", [seq], params, 0)
    lost.add(moving)
    for _ in range(8):
        plan = lost.schedule()
        assert plan is not None, "stuck in its first group"
        lost.update(plan, memory_fake_execute(plan))
    for g in lost.evacuate():
        other.add(g)
    for _ in range(100):
        if (plan := other.schedule()) is None:
            break
        other.update(plan, memory_fake_execute(plan))
    assert not other.has_work and moving.is_finished, "stuck in the group it moved to"
    if moving.beam is None:
        assert [s.num_output_tokens for s in moving.seqs] == [12, 12]


# ---- Router ----


def replica(name: str, num_blocks: int = 64) -> Replica:
    r = Replica(name, FakeWorker.__new__(FakeWorker))
    r.scheduler = scheduler(itertools.count(1000 * ord(name[0])), num_blocks=num_blocks)
    return r


def burst(replicas: list[Replica], count: int, prompt_len: int) -> None:
    """`count` requests routed one after another, each queued where the router puts it."""
    router, ids = Router(SchedulerConfig()), itertools.count()
    for i in range(count):
        g = group(ids, prompt_len, 4, i)
        target = router.pick(replicas, g.seqs[0].token_ids)
        assert target is not None
        target.post(g)


def test_a_burst_spreads_over_equal_groups_by_queued_demand() -> None:
    a, b = replica("a"), replica("b")
    burst([a, b], 6, 8)
    assert (a.num_queued, b.num_queued) == (3, 3)


def measured(r: Replica, tokens_per_s: float) -> Replica:
    for _ in range(MIN_STEPS):
        r.speed.observe(int(tokens_per_s * 0.01), 0.01)
    return r


def test_a_group_twice_as_fast_takes_about_two_thirds_of_a_burst() -> None:
    fast, slow = measured(replica("fast"), 2000), measured(replica("slow"), 1000)
    burst([slow, fast], 30, 2)
    assert 0.6 <= fast.num_queued / 30 <= 0.73, (fast.num_queued, slow.num_queued)  # room alone: 15 and 15


def test_groups_within_the_speed_spread_are_routed_by_room_alone() -> None:
    a, b = measured(replica("a"), 1100), measured(replica("b"), 1000)
    burst([a, b], 6, 8)
    assert (a.num_queued, b.num_queued) == (3, 3)


def test_a_group_speed_counts_busy_time_only_and_follows_a_change() -> None:
    speed = GroupSpeed()
    for _ in range(MIN_STEPS - 1):
        speed.observe(100, 0.1)
    assert speed.tokens_per_second == 0  # too few steps to count
    speed.observe(100, 0.1)
    assert speed.tokens_per_second == pytest.approx(1000)
    for _ in range(200):  # 10 s of steps at half the speed: two half-lives
        speed.observe(50, 0.1)
    assert 500 < speed.tokens_per_second < 500 + 500 * 0.3


def test_a_prompt_follows_its_cached_prefix_until_load_outweighs_it() -> None:
    router, ids = Router(SchedulerConfig()), itertools.count()
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
    assert Router(SchedulerConfig(enable_prefix_caching=False)).pick([a, b], prompt) is a
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
    spec: ModelSpec,
    tokenizer: Tokenizer,  # noqa: F811
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
    spec: ModelSpec,
    tokenizer: Tokenizer,  # noqa: F811
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


class ShortContextWorker(LosingWorker):
    """A group whose model has a shorter context; like a real worker, it refuses a plan past it."""

    def __init__(self, spec: ModelSpec, script: list[int], address: str, max_model_len: int, num_blocks: int) -> None:
        super().__init__(spec, script, address)
        self.max_model_len, self.num_blocks = max_model_len, num_blocks
        self.refused = 0

    async def connect(self, timeout: float) -> WorkerInfo:
        info = await super().connect(timeout)
        return dataclasses.replace(info, max_model_len=self.max_model_len, num_gpu_blocks=self.num_blocks)

    async def execute(self, plan: StepPlan) -> tuple[StepResult, StepTiming]:
        if int((plan.context_lens + plan.query_lens).max()) > self.max_model_len:
            self.refused += 1
            raise WorkerLost(f"{self.address}: positions outside the model's context of {self.max_model_len}")
        return await super().execute(plan)


async def test_a_request_past_another_groups_context_is_not_moved_there(
    spec: ModelSpec,
    tokenizer: Tokenizer,  # noqa: F811
) -> None:
    # Without max_tokens a request runs to the end of its group's context; `a`'s is 512 tokens.
    # Lost after 69 tokens, it cannot go on in `b`'s 64: it fails, and `b` is not fed past it.
    script = list(range(300, 340))
    a = LosingWorker(spec, script, "a", lose_at_step=70)
    b = ShortContextWorker(spec, script, "b", max_model_len=64, num_blocks=64)
    engine = await two_groups(spec, tokenizer, a, b)
    try:
        req = GenerationRequest(request_id="long", prompt_token_ids=(5, 6, 7), ignore_eos=True)
        with pytest.raises(Aborted, match="after 69 tokens"):
            [o async for o in engine.generate(req)]
        assert b.refused == 0 and [r.name for r in engine.replicas] == ["b"]
        assert len(await generate(engine, 1, 8)) == 8
    finally:
        await engine.stop()


async def test_stop_ends_requests_in_flight_as_shutting_down_not_as_lost(
    spec: ModelSpec,
    tokenizer: Tokenizer,  # noqa: F811
) -> None:
    script = list(range(300, 340))
    a, b = LosingWorker(spec, script, "a"), LosingWorker(spec, script, "b")
    a.delay = b.delay = 0.01
    engine = await two_groups(spec, tokenizer, a, b)
    tasks = [asyncio.create_task(generate(engine, i, 30)) for i in range(4)]
    await until(lambda: a.steps > 3 and b.steps > 3)
    await engine.stop()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    # Tokens were streamed, yet no worker was lost: the server is going away, retry elsewhere.
    assert all(isinstance(r, Unavailable) and "shutting down" in str(r) for r in results), results


class SlowStartWorker(LosingWorker):
    connect_delay = 0.0  # seconds the worker takes to answer the handshake

    async def connect(self, timeout: float) -> WorkerInfo:
        await asyncio.sleep(self.connect_delay)
        return await super().connect(timeout)


def registry_engine(
    spec: ModelSpec,
    tokenizer: Tokenizer,
    workers: dict[str, LosingWorker],
    connect_delay: dict[str, float] | None = None,
) -> Engine:
    """Registered groups: each address names a fake worker, made when its group completes."""

    def factory(addresses: list[str]) -> LosingWorker:
        worker = workers[addresses[0]] = SlowStartWorker(spec, list(range(300, 340)), addresses[0])
        worker.delay = 0.01
        worker.connect_delay = (connect_delay or {}).get(addresses[0], 0.0)
        return worker

    return Engine(spec, tokenizer, SchedulerConfig(), None, worker_factory=factory)


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


async def test_a_group_that_registers_again_while_its_old_link_tears_down_serves_again(
    spec: ModelSpec,
    tokenizer: Tokenizer,  # noqa: F811
) -> None:
    workers: dict[str, LosingWorker] = {}
    engine = registry_engine(spec, tokenizer, workers)
    engine.start()
    try:
        engine.attach_group("g", ["g-1"])
        await until(lambda: engine.ready)
        in_flight = asyncio.create_task(generate(engine, 0, 30))
        await until(lambda: workers["g-1"].steps > 2)
        # Its worker restarted and registered again before the old link's step came back.
        engine.detach_group("g")
        engine.attach_group("g", ["g-2"])
        # The new link is up before the old one's step returns: the request moves over to it.
        assert await in_flight == list(range(300, 330))
        assert [r.worker for r in engine.replicas] == [workers["g-2"]]
        assert await generate(engine, 1, 4) == list(range(300, 304))
    finally:
        await engine.stop()


async def test_an_abort_while_a_group_is_replaced_ends_the_request_it_names(
    spec: ModelSpec,
    tokenizer: Tokenizer,  # noqa: F811
) -> None:
    workers: dict[str, LosingWorker] = {}
    # The new g connects only after the old one's step returned and its requests moved to h.
    engine = registry_engine(spec, tokenizer, workers, connect_delay={"g-2": 0.1})
    engine.start()
    try:
        engine.attach_group("g", ["g-1"])
        engine.attach_group("h", ["h-1"])
        await until(lambda: len(engine.replicas) == 2)
        in_flight = asyncio.create_task(generate(engine, 0, 30))  # on g: ties go to the first
        await until(lambda: workers["g-1"].steps > 2)
        stream = engine._streams.get("q0")  # noqa: SLF001
        assert stream is not None
        group = stream.group
        engine.detach_group("g")
        engine.attach_group("g", ["g-2"])
        # The request is still on the old g, which has not torn down yet.
        assert engine.abort_requests(["q0"]) == ["q0"]
        then = group.seqs[0].num_output_tokens
        with pytest.raises(Cancelled):
            await in_flight
        await until(lambda: len(engine.replicas) == 2)
        await asyncio.sleep(0.1)  # 10 steps of h, had the request moved there
        assert group.seqs[0].num_output_tokens <= then + 1
        assert all(r.scheduler is not None and not r.scheduler.has_work for r in engine.replicas)
    finally:
        await engine.stop()


async def test_a_group_that_completes_its_registration_after_stop_is_not_served(
    spec: ModelSpec,
    tokenizer: Tokenizer,  # noqa: F811
) -> None:
    # The Register service answers until the server stops, which is after the engine stopped.
    workers: dict[str, LosingWorker] = {}
    engine = registry_engine(spec, tokenizer, workers)
    engine.start()
    engine.attach_group("g", ["g-1"])
    await until(lambda: engine.ready)
    await engine.stop()
    engine.attach_group("h", ["h-1"])
    assert "h-1" not in workers and not engine._fleet._replicas  # noqa: SLF001


class ScoringWorker(LosingWorker):
    """Also scores alternatives (beam search needs them), as test_scheduler_memory's fake does."""

    async def execute(self, plan: StepPlan) -> tuple[StepResult, StepTiming]:
        _, timing = await super().execute(plan)
        return memory_fake_execute(plan), timing


@pytest.mark.parametrize("shape", [{"n": 1, "best_of": 2, "temperature": 1.0, "seed": 3}, {"beam_width": 2}])
async def test_a_request_that_streamed_nothing_yet_fails_unavailable_even_with_tokens_made(
    spec: ModelSpec,
    tokenizer: Tokenizer,
    shape: dict[str, object],  # noqa: F811
) -> None:
    # best_of > n and beams send their outputs only at the end: the client saw nothing and may
    # retry, however many tokens the lost groups had made.
    script = list(range(300, 340))
    a, b = ScoringWorker(spec, script, "a", lose_at_step=6), ScoringWorker(spec, script, "b", lose_at_step=6)
    engine = await two_groups(spec, tokenizer, a, b)
    try:
        req = GenerationRequest(request_id="r", prompt_token_ids=(5, 6, 7), max_tokens=20, ignore_eos=True, **shape)  # type: ignore[arg-type]
        with pytest.raises(Unavailable, match="retry"):
            [o async for o in engine.generate(req)]
        assert a.gone and b.gone
    finally:
        await engine.stop()


class BrokenHandshakeWorker(LosingWorker):
    """Its first handshake fails with something other than WorkerLost (a malformed reply)."""

    failed = False

    async def connect(self, timeout: float) -> WorkerInfo:
        if not self.failed:
            self.failed = True
            raise ValueError("a malformed Describe reply")
        return await FakeWorker.connect(self, timeout)


async def test_an_unexpected_failure_outside_a_step_is_logged_and_the_group_retried(
    spec: ModelSpec,
    tokenizer: Tokenizer,  # noqa: F811
) -> None:
    worker = BrokenHandshakeWorker(spec, list(range(300, 340)), "a")
    engine = Engine(spec, tokenizer, SchedulerConfig(), [worker])  # type: ignore[list-item]
    engine.start()
    try:
        await until(lambda: engine.ready)
        assert worker.failed and worker.connects == 1
        assert await generate(engine, 0, 5) == list(range(300, 305))
    finally:
        await engine.stop()


async def test_requests_still_in_the_inbox_when_the_loop_fails_end_with_an_error(
    spec: ModelSpec,
    tokenizer: Tokenizer,
    monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    engine = Engine(spec, tokenizer, SchedulerConfig(), [LosingWorker(spec, list(range(300, 340)), "a")])  # type: ignore[list-item]
    engine.start()
    try:
        await until(lambda: engine.ready)
        original = Scheduler.add
        calls = {"n": 0}

        def add_failing_once(self: Scheduler, group: SequenceGroup) -> None:
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("a bug while adding")
            original(self, group)

        monkeypatch.setattr(Scheduler, "add", add_failing_once)
        # Posted together, so one inbox holds all three when the second add fails.
        results = await asyncio.wait_for(
            asyncio.gather(*(generate(engine, i, 4) for i in range(3)), return_exceptions=True), timeout=5
        )
        assert all(isinstance(r, Unavailable) and "internal engine failure" in str(r) for r in results), results
        monkeypatch.setattr(Scheduler, "add", original)
        await until(lambda: engine.ready)
        assert await generate(engine, 9, 3) == [300, 301, 302]
    finally:
        await engine.stop()
