"""The engine loop with a fake worker: failure handling, stop strings, aborts, drain.

The fake worker answers each sampled sequence with script[output_position], so the tokens a
request receives are known in advance.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import numpy as np
import pytest

from common.config import SchedulerConfig
from common.errors import Aborted, InvalidArgument, Unavailable
from common.model_spec import ModelSpec
from common.plan import StepPlan, StepResult
from common.worker_info import WorkerInfo
from scheduler_svc.engine.engine import Engine
from scheduler_svc.engine.request import GenerationRequest, RequestOutput
from scheduler_svc.sched.sequence import FinishReason
from scheduler_svc.text.tokenizer import Tokenizer
from scheduler_svc.workers.worker_client import StepTiming
from tests.engine_state import first_scheduler


class FakeWorker:
    address = "fake"

    def __init__(self, spec: ModelSpec, script: list[int], fail_at_step: int | None = None) -> None:
        self.spec = spec
        self.script = script
        self.fail_at_step = fail_at_step
        self.steps = 0
        self.connects = 0
        self.delay = 0.0

    async def connect(self, timeout: float) -> WorkerInfo:
        self.connects += 1
        return WorkerInfo(
            self.spec.name, self.spec.vocab_size, self.spec.max_model_len, "float32", "cpu", 0, 1, 16, 64, 0
        )

    async def execute(self, plan: StepPlan) -> tuple[StepResult, StepTiming]:
        self.steps += 1
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail_at_step == self.steps:
            raise RuntimeError("a bug somewhere in the step path")
        pos = plan.sampling.output_position
        tokens = np.where(plan.sample == 1, [self.script[p % len(self.script)] for p in pos], -1).astype(np.int32)
        return StepResult(plan.step_id, tokens), StepTiming(0, 0.0, 0.0)

    async def close(self) -> None:
        pass


@pytest.fixture
def spec(tiny_model_dir: Path) -> ModelSpec:
    return ModelSpec.from_dir(tiny_model_dir)


@pytest.fixture
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer(tiny_model_dir)


async def started(spec: ModelSpec, tokenizer: Tokenizer, worker: FakeWorker) -> Engine:
    engine = Engine(spec, tokenizer, SchedulerConfig(), worker)  # type: ignore[arg-type]
    engine.start()
    for _ in range(100):
        if engine.ready:
            return engine
        await asyncio.sleep(0.01)
    raise TimeoutError("engine not ready")


def tokens_of(outs: list[RequestOutput]) -> list[int]:
    """The streamed tokens (a message carries several when the reader lagged behind)."""
    return [t for o in outs for t in o.token_ids]


async def run(engine: Engine, **fields: object) -> list[RequestOutput]:
    req = GenerationRequest(**{"request_id": "", "prompt_token_ids": (5, 6, 7), "max_tokens": 8, **fields})  # type: ignore[arg-type]
    return [out async for out in engine.generate(req)]


async def test_a_crash_in_the_loop_fails_requests_and_the_engine_recovers(
    spec: ModelSpec, tokenizer: Tokenizer
) -> None:
    worker = FakeWorker(spec, [300, 301, 302], fail_at_step=3)
    engine = await started(spec, tokenizer, worker)
    try:
        with pytest.raises(Aborted, match="after 2 tokens"):
            await run(engine, ignore_eos=True)
        for _ in range(100):  # the engine rebuilds itself and reconnects
            if engine.ready and worker.connects == 2:
                break
            await asyncio.sleep(0.01)
        outs = await run(engine, ignore_eos=True, max_tokens=4)
        assert tokens_of(outs) == [300, 301, 302, 300]
        assert first_scheduler(engine) is not None and first_scheduler(engine).block_manager.num_used_blocks == 0
    finally:
        await engine.stop()


async def test_a_crash_before_any_token_is_unavailable(spec: ModelSpec, tokenizer: Tokenizer) -> None:
    engine = await started(spec, tokenizer, FakeWorker(spec, [300], fail_at_step=1))
    try:
        with pytest.raises(Unavailable, match="retry"):
            await run(engine)
    finally:
        await engine.stop()


async def test_stop_string_on_the_last_allowed_token_reports_stop_sequence(
    spec: ModelSpec, tokenizer: Tokenizer
) -> None:
    script = tokenizer.encode(" alpha beta gamma")
    engine = await started(spec, tokenizer, FakeWorker(spec, script))
    try:
        outs = await run(engine, max_tokens=len(script), stop=("gamma",), ignore_eos=True)
        assert outs[-1].finish_reason is FinishReason.STOP_SEQUENCE
        assert "".join(o.text for o in outs) == " alpha beta "
    finally:
        await engine.stop()


async def test_a_late_abort_does_not_hit_a_new_request_with_the_same_id(spec: ModelSpec, tokenizer: Tokenizer) -> None:
    worker = FakeWorker(spec, [300, 301])
    worker.delay = 0.01
    engine = await started(spec, tokenizer, worker)
    try:
        first = engine.generate(GenerationRequest(request_id="x", prompt_token_ids=(1, 2), max_tokens=3))
        outs = [o async for o in first]
        assert outs[-1].finish_reason is FinishReason.LENGTH
        engine._abort(engine._streams.get("x") or _stale_stream(engine, outs))  # noqa: SLF001
        second = await run(engine, request_id="x", max_tokens=3)
        assert second[-1].finish_reason is FinishReason.LENGTH and len(second) == 3
    finally:
        await engine.stop()


def _stale_stream(engine: Engine, outs: list[RequestOutput]):  # type: ignore[no-untyped-def]
    """A finished request's stream object, as a cancelled handler would still hold it."""
    from scheduler_svc.engine.request_stream import RequestStream
    from scheduler_svc.sched.sequence import SamplingOptions, Sequence, StoppingParams
    from scheduler_svc.sched.sequence_group import SequenceGroup

    seq = Sequence(10**6, "x", [1, 2], SamplingOptions(), StoppingParams(max_tokens=3), arrival=10**6)
    return RequestStream(SequenceGroup("x", [seq], seq.sampling, 10**6), engine.tokenizer, 0)


async def test_huge_top_k_and_tiny_temperature_are_safe(spec: ModelSpec, tokenizer: Tokenizer) -> None:
    engine = await started(spec, tokenizer, FakeWorker(spec, [300]))
    try:
        outs = await run(engine, top_k=3_000_000_000, temperature=1e-30, max_tokens=2)
        assert len(tokens_of(outs)) == 2
    finally:
        await engine.stop()


async def test_drain_lets_in_flight_requests_finish_and_refuses_new_ones(spec: ModelSpec, tokenizer: Tokenizer) -> None:
    worker = FakeWorker(spec, [300])
    worker.delay = 0.02
    engine = await started(spec, tokenizer, worker)
    try:
        in_flight = asyncio.create_task(run(engine, max_tokens=10, ignore_eos=True))
        await asyncio.sleep(0.05)
        drain = asyncio.create_task(engine.drain(5.0))
        await asyncio.sleep(0.01)
        with pytest.raises(Unavailable, match="shutting down"):
            await run(engine)
        await drain
        outs = await in_flight
        assert outs[-1].finish_reason is FinishReason.LENGTH and len(tokens_of(outs)) == 10
    finally:
        await engine.stop()


class SeedScriptWorker(FakeWorker):
    """The sample drawing with the request's own seed reads `first`, every other sample `other`."""

    def __init__(self, spec: ModelSpec, seed: int, first: list[int], other: list[int]) -> None:
        super().__init__(spec, first)
        self.seed, self.first, self.other = seed, first, other

    async def execute(self, plan: StepPlan) -> tuple[StepResult, StepTiming]:
        tokens = [
            (self.first if int(plan.sampling.seed[i]) == self.seed else self.other)[
                int(plan.sampling.output_position[i])
            ]
            if plan.sample[i]
            else -1
            for i in range(plan.num_seqs)
        ]
        return StepResult(plan.step_id, np.array(tokens, np.int32)), StepTiming(0, 0.0, 0.0)


async def test_every_sample_gets_its_final_message_when_a_sibling_stops_in_the_same_step(
    spec: ModelSpec, tokenizer: Tokenizer
) -> None:
    # Step 2: sample 0 completes the stop string "beta", sample 1 emits eos. Both must end.
    first = tokenizer.encode(" alpha beta")
    eos = min(spec.eos_token_ids)
    engine = await started(spec, tokenizer, SeedScriptWorker(spec, 123, first, [first[0], eos]))
    try:
        outs = await run(engine, n=2, temperature=1.0, seed=123, stop=("beta",))
        finals = {o.index: o.finish_reason for o in outs if o.finish_reason is not None}
        assert finals == {0: FinishReason.STOP_SEQUENCE, 1: FinishReason.STOP}
        assert first_scheduler(engine) is not None and first_scheduler(engine).block_manager.num_used_blocks == 0
    finally:
        await engine.stop()


async def test_a_width_beyond_the_servers_batch_is_refused(spec: ModelSpec, tokenizer: Tokenizer) -> None:
    engine = Engine(spec, tokenizer, SchedulerConfig(max_num_seqs=2), FakeWorker(spec, [300]))  # type: ignore[arg-type]
    engine.start()
    try:
        while not engine.ready:
            await asyncio.sleep(0.01)
        with pytest.raises(InvalidArgument, match="max-num-seqs"):
            await run(engine, n=3, temperature=1.0)
        with pytest.raises(InvalidArgument, match="beam_width"):
            await run(engine, beam_width=3)
    finally:
        await engine.stop()


async def test_request_limits_are_server_flags(spec: ModelSpec, tokenizer: Tokenizer) -> None:
    config = SchedulerConfig(max_prompt_tokens=4, max_logprobs=2, max_stop_strings=1, max_n=2)
    engine = Engine(spec, tokenizer, config, FakeWorker(spec, [300]))  # type: ignore[arg-type]
    engine.start()
    try:
        while not engine.ready:
            await asyncio.sleep(0.01)
        cases = [
            ({"prompt_token_ids": (1, 2, 3, 4, 5)}, "--max-prompt-tokens (4)"),
            ({"logprobs": 3}, "at most 2 alternatives"),
            ({"stop": ("a", "b")}, "at most 1 stop strings"),
            ({"n": 3, "temperature": 1.0}, "at most 2"),
        ]
        for fields, message in cases:
            with pytest.raises(InvalidArgument, match=re.escape(message)):
                await run(engine, **fields)
        assert len(tokens_of(await run(engine, prompt_token_ids=(1, 2, 3, 4), logprobs=2, max_tokens=2))) == 2
    finally:
        await engine.stop()


async def test_a_slow_reader_gets_the_queued_pieces_of_an_output_in_one_message(
    spec: ModelSpec, tokenizer: Tokenizer
) -> None:
    script = tokenizer.encode(" the quick brown fox jumps over the lazy dog", add_special_tokens=False)
    worker = FakeWorker(spec, script)
    worker.delay = 0.01  # a step takes a while: a reader that keeps up gets one token per message
    engine = await started(spec, tokenizer, worker)
    try:
        req = GenerationRequest(request_id="", prompt_token_ids=(5, 6, 7), max_tokens=len(script), ignore_eos=True)
        quick = [out async for out in engine.generate(req)]
        slow = []
        async for out in engine.generate(req):
            slow.append(out)
            await asyncio.sleep(0.05)  # meanwhile the engine runs several steps
    finally:
        await engine.stop()
    assert [len(o.token_ids) for o in quick] == [1] * len(script)
    assert len(slow) < len(quick) and max(len(o.token_ids) for o in slow) > 1
    for outs in (quick, slow):
        assert [t for o in outs for t in o.token_ids] == script
        assert "".join(o.text for o in outs) == tokenizer.decode(script)
        assert outs[-1].completion_tokens == len(script) and outs[-1].finish_reason is FinishReason.LENGTH
