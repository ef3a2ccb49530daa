"""Randomized: several fake worker groups that break, come back or leave, under a random load.

The fake worker keeps a real (shadow) KV cache: each block holds the token ids written into
it, block operations move them, and a sampled token is a function of the tokens read back from
the cache (plus seed and position for sampling). A moved, preempted or recomputed request that
read a stale or foreign block would therefore draw other tokens than the same request run alone
on a big pool, which is the reference every completed request is compared with.

Per seed: 2-4 groups (fixed --worker ones, or registered ones that deregister and come back,
at once or a little later), small pools with or without a host pool (so both preemption modes
happen), requests of every shape (n, best_of, beams, penalties, priorities), client cancels and
Abort calls, lost steps, and in some runs a stop() while requests are in flight. Checked: every
request ends once, the way its fate allows (exact tokens, or CANCELLED after an Abort, ABORTED
only after streamed tokens, UNAVAILABLE only before any, "shutting down" on stop); a request
given up runs at most one more step; nothing is left in flight and no group loop after stop;
every group that should serve does, with an empty scheduler whose blocks are all free and
consistent; no engine failure. A seed fixes the run's plan, not its interleaving (the fakes
sleep for real), so a failure message describes where the stuck requests are.

60 seeds take about 15 s on 2 cores; raise SEEDS locally to fuzz longer.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import scheduler_svc.engine.fleet as fleet_module
from common.config import SchedulerConfig
from common.errors import Aborted, Cancelled, ResourceExhausted, Unavailable
from common.model_spec import ModelSpec
from common.plan import StepPlan, StepResult
from common.worker_info import WorkerInfo
from scheduler_svc.engine.engine import Engine
from scheduler_svc.engine.request import GenerationRequest, Limits, RequestOutput, sampling_options, stopping_params
from scheduler_svc.kv.block_manager import BlockManager
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.sequence import FinishReason, Sequence
from scheduler_svc.sched.sequence_group import SequenceGroup
from scheduler_svc.text.tokenizer import Tokenizer
from scheduler_svc.workers.worker_client import StepTiming, WorkerLost
from tests.test_engine import spec, tokenizer  # noqa: F401 (fixtures)
from tests.test_scheduler_memory import VOCAB, FakeRows, _mix

BLOCK_SIZE = 8  # the smallest a worker may report (common/worker_info.py BLOCK_SIZES)
SEEDS = range(60)


class ShadowModel:
    """A model whose next token depends only on what its KV cache holds for the sequence."""

    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.gpu = [[-1] * BLOCK_SIZE for _ in range(num_gpu_blocks)]
        self.cpu = [[-1] * BLOCK_SIZE for _ in range(num_cpu_blocks)]

    def step(self, plan: StepPlan) -> StepResult:
        for src, dst in plan.swap_out.tolist():
            self.cpu[dst] = list(self.gpu[src])
        for src, dst in plan.swap_in.tolist():
            self.gpu[dst] = list(self.cpu[src])
        for src, dst in plan.copy.tolist():
            self.gpu[dst] = list(self.gpu[src])
        n = plan.num_seqs
        rows = FakeRows(plan)
        starts = np.concatenate([[0], np.cumsum(plan.query_lens)]).tolist()
        history = plan.sampling.history_offsets
        for i in range(n):
            c, q = int(plan.context_lens[i]), int(plan.query_lens[i])
            table = plan.block_tables.row(i).tolist()
            for j in range(q):
                block = table[(c + j) // BLOCK_SIZE]
                assert block >= 0, f"step {plan.step_id} row {i}: position {c + j} has no block"
                self.gpu[block][(c + j) % BLOCK_SIZE] = int(plan.input_ids[starts[i] + j])
            if not plan.sample[i]:
                continue
            seen = [self.gpu[table[p // BLOCK_SIZE]][p % BLOCK_SIZE] for p in range(c + q)]
            assert -1 not in seen, f"step {plan.step_id} row {i} reads KV never written"
            if history.size and history[i + 1] > history[i]:
                sent = plan.sampling.history_token_ids[history[i] : history[i + 1]].tolist()
                assert sent == seen, f"step {plan.step_id} row {i}: penalty history differs from the cache"
            rows.sample(i, _mix(*seen))
        return rows.result()


class FuzzWorker:
    """A worker process: it may break its stream at a step and stay unreachable for a while."""

    def __init__(
        self, spec: ModelSpec, address: str, num_gpu_blocks: int, num_cpu_blocks: int, rng: random.Random
    ) -> None:
        self.spec = spec
        self.address = address
        self.num_gpu_blocks, self.num_cpu_blocks = num_gpu_blocks, num_cpu_blocks
        self.rng = rng
        self.model = ShadowModel(num_gpu_blocks, num_cpu_blocks)
        self.closed = asyncio.Event()
        self.lose_next = False
        self.down_for = 0  # connect attempts refused after a loss (-1: for good)
        self.errors: list[str] = []
        self.swaps = 0  # steps that swapped blocks out

    async def connect(self, timeout: float) -> WorkerInfo:
        await asyncio.sleep(self.rng.choice([0, 0, 0.001]))
        if self.down_for:
            self.down_for -= self.down_for > 0
            raise WorkerLost(f"{self.address} is unreachable")
        self.closed = asyncio.Event()
        self.model = ShadowModel(self.num_gpu_blocks, self.num_cpu_blocks)  # a fresh cache
        return WorkerInfo(
            self.spec.name,
            self.spec.vocab_size,
            self.spec.max_model_len,
            "float32",
            "cpu",
            0,
            1,
            BLOCK_SIZE,
            self.num_gpu_blocks,
            self.num_cpu_blocks,
            block_bytes=1000,
        )

    async def execute(self, plan: StepPlan) -> tuple[StepResult, StepTiming]:
        if self.closed.is_set():
            raise WorkerLost(f"{self.address} is not connected")
        try:
            await asyncio.wait_for(self.closed.wait(), self.rng.choice([0, 0.0005, 0.001, 0.002]))
            raise WorkerLost(f"{self.address} was closed during step {plan.step_id}")
        except TimeoutError:
            pass
        if self.lose_next:
            self.lose_next = False
            raise WorkerLost(f"{self.address} broke its stream")
        self.swaps += bool(plan.swap_out.size)
        try:
            result = self.model.step(plan)
        except (AssertionError, IndexError) as error:
            self.errors.append(f"{self.address}: {error}")
            raise
        return result, StepTiming(0, 0.0, 0.0)

    async def close(self) -> None:
        self.closed.set()


# ---- the requests and what they must produce ----


@dataclass
class Fate:
    req: GenerationRequest
    expected: dict[int, tuple[list[int], FinishReason | None]]  # by output index
    need_blocks: int
    streams: bool
    cancel_after: int | None = None  # the client goes away after this many messages
    abort_after: int | None = None  # an Abort call after this many messages
    outputs: list[RequestOutput] = field(default_factory=list)
    error: BaseException | None = None
    aborted: bool = False  # Abort returned its id
    cancelled: bool = False
    # The request's group and its longest output when the client gave up on it.
    given_up: tuple[SequenceGroup, int] | None = None

    def give_up(self, engine: Engine) -> None:
        stream = engine._streams.get(self.req.request_id)  # noqa: SLF001
        if stream is not None and self.given_up is None:
            self.given_up = (stream.group, longest(stream.group))


def longest(group: SequenceGroup) -> int:
    return max(s.num_output_tokens for s in group.seqs)


def reference(spec: ModelSpec, req: GenerationRequest) -> tuple[dict[int, tuple[list[int], FinishReason | None]], int]:
    """What the request yields alone on a pool that never preempts, and the blocks it needs."""
    limits = Limits.of(spec, SchedulerConfig())
    bm = BlockManager(4096, BLOCK_SIZE, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(), bm, spec.max_model_len, spec.eos_token_ids, block_bytes=1000)
    assert req.seed is not None
    sampling = sampling_options(req, req.seed, limits)
    seq = Sequence(
        s.queues.new_seq_id(), req.request_id, list(req.prompt_token_ids), sampling, stopping_params(req), arrival=0
    )
    group = SequenceGroup(req.request_id, [seq], sampling, 0)
    s.add(group)
    model = ShadowModel(4096, 0)
    while (plan := s.schedule()) is not None:
        s.update(plan, model.step(plan))
    assert not s.has_work
    expected: dict[int, tuple[list[int], FinishReason | None]]
    if group.beam is not None:
        hyps = group.beam.pool[: sampling.n]
        expected = {i: (list(h.output_token_ids), h.finish_reason) for i, h in enumerate(hyps)}
    elif group.streams:
        expected = {q.index: (q.output_token_ids, q.finish_reason) for q in group.seqs}
    else:
        expected = {i: (q.output_token_ids, q.finish_reason) for i, q in enumerate(group.best())}
    width = max(sampling.best_of, sampling.beam_width)
    total = len(req.prompt_token_ids) + req.max_tokens
    return expected, s.blocks_for_group(len(req.prompt_token_ids), total, width)


def random_request(rng: random.Random, spec: ModelSpec, i: int, prefixes: list[list[int]]) -> Fate:
    prompt = list(rng.choice(prefixes)) if rng.random() < 0.5 else []
    prompt += [rng.randrange(3, 40000) for _ in range(rng.randint(1, 14))]
    shape: dict[str, Any] = {}
    r = rng.random()
    if r < 0.15:
        shape = {"n": 2, "temperature": 1.0}
    elif r < 0.25:
        shape = {"n": 1, "best_of": rng.randint(2, 3), "temperature": 1.0}
    elif r < 0.35:
        shape = {"beam_width": rng.randint(2, 3), "n": rng.randint(1, 2)}
    elif r < 0.45:
        shape = {"temperature": 0.8}
    beam = "beam_width" in shape
    if rng.random() < 0.15 and not beam:  # beams take no penalties nor min_tokens
        shape["repetition_penalty"] = 1.2
    if rng.random() < 0.2:
        shape["stop_token_ids"] = (rng.randrange(VOCAB),)
    max_tokens = rng.randint(1, 24)
    req = GenerationRequest(
        request_id=f"q{i}",
        prompt_token_ids=tuple(prompt),
        max_tokens=max_tokens,
        seed=rng.randrange(1 << 40),
        ignore_eos=rng.random() < 0.6,
        min_tokens=0 if beam else min(max_tokens, rng.choice([0, 0, 0, 2])),
        priority=rng.choice([0, 0, 0, 1, 2]),
        **shape,
    )
    expected, need = reference(spec, req)
    fate = Fate(req, expected, need, streams=not req.beam_width > 1 and (req.best_of or req.n or 1) == (req.n or 1))
    if rng.random() < 0.12:
        fate.cancel_after = rng.randint(0, 4)
    elif rng.random() < 0.12:
        fate.abort_after = rng.randint(0, 4)
    return fate


class _FastAsyncio:
    """The engine's asyncio with its retry pauses (1 s before reconnecting) cut short."""

    def __getattr__(self, name: str) -> Any:
        return getattr(asyncio, name)

    @staticmethod
    async def sleep(delay: float, result: Any = None) -> Any:
        return await asyncio.sleep(min(delay, 0.005), result)


class EventLog:
    """Stands in for the engine's logger: keeps the events, so a failure of the loop shows."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Any:
        def record(event: str, **kw: Any) -> None:
            self.events.append((level, event, kw))

        return record


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> Iterator[EventLog]:
    log = EventLog()
    monkeypatch.setattr(fleet_module, "asyncio", _FastAsyncio())
    monkeypatch.setattr(fleet_module, "log", log)
    yield log


# ---- one run ----


async def consume(engine: Engine, fate: Fate, tasks: dict[str, asyncio.Task[None]]) -> None:
    try:
        async for out in engine.generate(fate.req):
            fate.outputs.append(out)
            if fate.abort_after is not None and len(fate.outputs) >= fate.abort_after and not fate.aborted:
                fate.give_up(engine)
                fate.aborted = bool(engine.abort_requests([fate.req.request_id]))
            if fate.cancel_after is not None and len(fate.outputs) >= fate.cancel_after:
                fate.give_up(engine)
                tasks[fate.req.request_id].cancel()
            await asyncio.sleep(0)
    except asyncio.CancelledError:
        fate.cancelled = True
    except (Aborted, Unavailable, Cancelled, ResourceExhausted) as error:
        fate.error = error


@dataclass
class Run:
    rng: random.Random
    spec: ModelSpec
    registered: bool
    engine: Engine
    workers: dict[str, FuzzWorker]  # by address
    pools: dict[str, tuple[int, int]]  # group name -> (device, host blocks)
    attached: dict[str, str] = field(default_factory=dict)  # group name -> current address (registered)
    losses: int = 0
    generation: int = 0

    def new_worker(self, address: str, name: str) -> FuzzWorker:
        gpu, cpu = self.pools[name]
        worker = FuzzWorker(self.spec, address, gpu, cpu, random.Random(address))
        self.workers[address] = worker
        return worker

    def attach(self, name: str) -> None:
        self.generation += 1
        address = f"{name}@{self.generation}:{self.rng.random()}"
        self.attached[name] = address
        self.engine.attach_group(name, [address])

    async def chaos(self) -> None:
        """Break links at random steps; registered groups also leave and come back."""
        rng = self.rng
        for _ in range(rng.randint(1, 5)):
            await asyncio.sleep(rng.uniform(0.002, 0.03))
            if self.registered and rng.random() < 0.5:
                live = sorted(self.attached)
                if not live:
                    continue
                name = rng.choice(live)
                self.losses += 1
                gone = self.workers.get(self.attached.pop(name))
                if gone is not None:
                    gone.down_for = -1  # its process is gone
                self.engine.detach_group(name)
                if rng.random() < 0.7:
                    # It comes back (restarted) at once or a little later, under the same name.
                    if rng.random() < 0.5:
                        await asyncio.sleep(rng.uniform(0, 0.01))
                    self.attach(name)
            else:
                addresses = self.attached.values() if self.registered else self.workers
                candidates = [self.workers[a] for a in addresses if a in self.workers]
                if not candidates:
                    continue
                worker = rng.choice(candidates)
                self.losses += 1
                worker.lose_next = True
                # A registered worker gone for good would also deregister: it only blips here.
                worker.down_for = rng.choice([0, 1, 3] if self.registered else [0, 1, 3, -1])


async def fuzz_once(seed: int, spec: ModelSpec, tokenizer: Tokenizer, events: EventLog) -> Counter[str]:
    """One random run; returns what happened in it (outcomes, losses, moves, preemptions)."""
    rng = random.Random(seed)
    num_groups = rng.randint(2, 4)
    registered = seed % 3 == 2
    config = SchedulerConfig(
        max_num_seqs=rng.randint(3, 8),
        max_num_batched_tokens=rng.choice([8, 16, 32, 64]),
        preemption_mode=rng.choice(["swap", "recompute", "auto"]),
        enable_prefix_caching=rng.random() < 0.7,
        max_queue_len=1000,
    )
    pools = {f"g{i}": (rng.randint(6, 16), rng.choice([0, 4, 12, 32])) for i in range(num_groups)}
    workers: dict[str, FuzzWorker] = {}
    run: Run
    if registered:
        engine = Engine(
            spec, tokenizer, config, None, worker_factory=lambda a: run.new_worker(a[0], a[0].split("@")[0])
        )
        run = Run(random.Random(~seed), spec, True, engine, workers, pools)
        for name in pools:
            run.attach(name)
    else:
        static = [
            FuzzWorker(spec, name, gpu, cpu, random.Random(f"{seed}{name}")) for name, (gpu, cpu) in pools.items()
        ]
        workers.update((w.address, w) for w in static)
        engine = Engine(spec, tokenizer, config, static)  # type: ignore[arg-type]
        run = Run(random.Random(~seed), spec, False, engine, workers, pools)
    engine.start()
    for _ in range(200):
        if len(engine.replicas) == num_groups:
            break
        await asyncio.sleep(0.002)
    smallest = min(gpu for gpu, _ in pools.values())
    prefixes = [[rng.randrange(3, 40000) for _ in range(rng.randint(4, 12))] for _ in range(3)]
    fates = [random_request(rng, spec, i, prefixes) for i in range(rng.randint(10, 24))]
    stop_early = seed % 5 == 4
    tasks: dict[str, asyncio.Task[None]] = {}
    # Half the runs that stop early have no other trouble: every request cut must say "shutting
    # down"; the other half stop while groups break, leave and come back.
    chaos = asyncio.create_task(run.chaos()) if seed % 6 != 0 and seed % 10 != 4 else None
    try:
        for fate in fates:
            tasks[fate.req.request_id] = asyncio.create_task(consume(engine, fate, tasks))
            await asyncio.sleep(rng.choice([0, 0, 0.001, 0.003]))
        if stop_early:
            await asyncio.sleep(rng.uniform(0, 0.02))
            await asyncio.wait_for(engine.stop(), 5)
        done, pending = await asyncio.wait(tasks.values(), timeout=30)
        if pending:
            raise AssertionError(
                f"requests never ended: {describe(engine, [f for f in fates if not tasks[f.req.request_id].done()])}"
            )
        if chaos is not None:
            await asyncio.wait_for(chaos, 5)
        if not stop_early:
            await quiesce(run)
            check_engine(run)
    finally:
        if chaos is not None:
            chaos.cancel()
        await asyncio.wait_for(engine.stop(), 5)
    assert not engine._fleet._replicas and not engine._streams  # noqa: SLF001
    await asyncio.sleep(0.02)
    left = [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("engine:")]
    assert not left, f"group loops still running after stop: {left}"
    failures = [e for e in events.events if e[1] == "engine_failed"]
    assert not failures, failures
    assert not [e for w in workers.values() for e in w.errors]
    for fate in fates:
        check_fate(fate, smallest, lossy=run.losses > 0, stopped=stop_early)
    m = engine.metrics
    outcomes = Counter(type(f.error).__name__ if f.error else "cancelled" if f.cancelled else "finished" for f in fates)
    return outcomes + Counter(
        requests=len(fates),
        losses=run.losses,
        moved=int(m.recovered._value.get()),  # noqa: SLF001
        preemptions=int(m.preemptions._value.get()),  # noqa: SLF001
        swaps=sum(w.swaps for w in workers.values()),
    )


def describe(engine: Engine, fates: list[Fate]) -> str:
    """Where the given requests are, for a failure message."""
    lines = []
    for fate in fates:
        stream = engine._streams.get(fate.req.request_id)  # noqa: SLF001
        replica = None if stream is None else engine._streams.replica_of(stream)  # noqa: SLF001
        where = "no stream" if stream is None else f"on {replica.name if replica else None}"
        lines.append(f"{fate.req.request_id} ({len(fate.outputs)} messages) {where}")
    for r in engine._fleet._replicas.values():  # noqa: SLF001
        queues = ""
        if r.scheduler is not None:
            s = r.scheduler
            queues = " ".join(
                f"{q}={[g.request_id for g in getattr(s.queues, q)]}" for q in ("waiting", "running", "swapped")
            )
            bm = s.block_manager
            queues += f" free={bm.num_free_blocks}/{bm.num_blocks} seqs={r.scheduler.config.max_num_seqs}"
            for g in s.queues.waiting[:1]:
                queues += (
                    f" head: width={g.width} forked={g.forked} beam={g.is_beam} prompt={g.seqs[0].num_prompt_tokens}"
                    f" tokens={[q.num_tokens for q in g.live()]} limit={g.seqs[0].token_limit}"
                    f" need={s._planner._admission_need(g, s.config.max_num_batched_tokens)}"  # noqa: SLF001
                    f" preempted_step={g.preempted_step} next_step={s.next_step_id}"
                )
        lines.append(f"group {r.name}: attached={r.attached} inbox={len(r.inbox)} task={r.task} {queues}")
    return "; ".join(lines)


async def quiesce(run: Run) -> None:
    """Wait for the last aborts to be applied and for every group that should serve to serve."""
    engine = run.engine
    for _ in range(400):
        replicas = engine._fleet._replicas.values()  # noqa: SLF001
        idle = all(not r.inbox and (r.scheduler is None or not r.scheduler.has_work) for r in replicas)
        if run.registered:
            expected = set(run.attached)
        else:
            expected = {a for a, w in run.workers.items() if w.down_for >= 0}
        serving = {r.name for r in engine.replicas}
        if idle and not engine._streams and serving >= expected:  # noqa: SLF001
            return
        await asyncio.sleep(0.005)
    raise AssertionError(
        f"not quiet: streams {list(engine._streams)}, serving {sorted(serving)}, expected {sorted(expected)}"  # noqa: SLF001
    )


def check_engine(run: Run) -> None:
    engine = run.engine
    for replica in engine._fleet._replicas.values():  # noqa: SLF001
        sched = replica.scheduler
        if sched is None:
            continue
        sched.check_integrity()
        bm = sched.block_manager
        assert not sched.has_work, replica.name
        assert bm.device.num_free == bm.num_blocks and bm.host.num_free == bm.host.num_blocks, replica.name
    assert engine.metrics.group_names() <= {r.name for r in engine.replicas}


def check_fate(fate: Fate, smallest_pool: int, lossy: bool, stopped: bool) -> None:
    rid = fate.req.request_id
    got: dict[int, list[int]] = {}
    ends: dict[int, FinishReason] = {}
    for out in fate.outputs:
        assert out.index not in ends, f"{rid}: output {out.index} continues after its end"
        got.setdefault(out.index, []).extend(out.token_ids)
        if out.finish_reason is not None:
            ends[out.index] = out.finish_reason
    # Whatever happened, what the client saw is a prefix of what the request must produce.
    for index, tokens in got.items():
        want = fate.expected[index][0]
        assert tokens == want[: len(tokens)], f"{rid} output {index}: {tokens} is not a prefix of {want}"
    streamed = sum(len(t) for t in got.values())
    if fate.given_up is not None:
        # Its blocks go at its group's next step boundary: at most the step in flight finishes.
        # (That no scheduler still holds it, check_engine saw.)
        group, then = fate.given_up
        assert longest(group) <= then + 2, f"{rid} ran on from {then} to {longest(group)} tokens after its client left"
    if fate.cancelled:
        assert fate.cancel_after is not None, f"{rid} was cancelled by nobody"
        return
    if fate.error is None:
        assert ends.keys() == fate.expected.keys(), f"{rid}: ended outputs {sorted(ends)} of {sorted(fate.expected)}"
        for index, (tokens, reason) in fate.expected.items():
            assert (got[index], ends[index]) == (tokens, reason), f"{rid} output {index}"
        return
    error = fate.error
    if isinstance(error, Cancelled):
        assert fate.aborted, f"{rid}: CANCELLED without an Abort call"
    elif isinstance(error, ResourceExhausted):
        assert fate.need_blocks > smallest_pool, f"{rid}: refused, though it needs {fate.need_blocks} blocks"
        assert not fate.outputs
    elif stopped and "shutting down" in str(error):
        assert isinstance(error, Unavailable), f"{rid}: {error!r}"
    else:
        assert lossy, f"{rid} failed without a lost worker: {error!r}"
        if isinstance(error, Unavailable):
            assert streamed == 0, f"{rid}: UNAVAILABLE after {streamed} tokens"
        else:
            assert streamed > 0, f"{rid}: ABORTED with nothing streamed"


async def test_recovery_fuzz(spec: ModelSpec, tokenizer: Tokenizer, events: EventLog) -> None:  # noqa: F811
    totals: Counter[str] = Counter()
    for seed in SEEDS:
        events.events.clear()
        try:
            totals += await fuzz_once(seed, spec, tokenizer, events)
        except BaseException as error:
            raise AssertionError(f"seed {seed}: {error}") from error
    print(f"recovery fuzz, {len(SEEDS)} seeds: {dict(totals)}")
    # The runs must reach what they are here for.
    for what in ("moved", "preemptions", "swaps", "finished", "cancelled", "Cancelled", "Aborted", "Unavailable"):
        assert totals[what] > 0, (what, totals)
