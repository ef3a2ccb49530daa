"""The real services on real ports: an in-process scheduler server and a worker subprocess.

Every test that uses `tiny_scheduler` ends with all requests gone and every KV block back in
the free pool (the fixture checks, integrity included).
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.pb.llmserve.v1 import generation_pb2 as pb
from tests.conftest import (
    KERNEL_DEVICE,
    Scheduler,
    collect,
    free_port,
    request,
    start_scheduler,
    start_worker,
    stop_scheduler,
)
from tests.engine_state import first_scheduler


async def test_stream_delivers_every_token_then_the_finish_reason(tiny_scheduler: Scheduler) -> None:
    gen = await collect(tiny_scheduler.stub, request(ids=[10, 20, 30, 40], max_tokens=7, ignore_eos=True))
    assert len(gen.token_ids) == 7
    assert [m.completion_tokens for m in gen.messages] == list(range(1, 8))
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in gen.messages[:-1])
    assert gen.final.finish_reason == pb.FINISH_REASON_LENGTH
    assert gen.final.prompt_tokens == 4
    assert gen.final.request_id  # assigned by the server


async def test_text_prompt_is_tokenized_by_the_server(tiny_scheduler: Scheduler) -> None:
    tokenizer = tiny_scheduler.engine.tokenizer
    prompt = "Hello there, how are you?"
    by_text = await collect(tiny_scheduler.stub, request(prompt, max_tokens=5, ignore_eos=True))
    by_ids = await collect(tiny_scheduler.stub, request(ids=tokenizer.encode(prompt), max_tokens=5, ignore_eos=True))
    assert by_text.final.prompt_tokens == len(tokenizer.encode(prompt))
    assert by_text.token_ids == by_ids.token_ids
    assert by_text.text == by_ids.text


async def test_concurrent_requests_equal_their_solo_runs(tiny_scheduler: Scheduler) -> None:
    prompts = [[100 + i * 37 + k for k in range(3 + 5 * i)] for i in range(8)]
    solo = [await collect(tiny_scheduler.stub, request(ids=p, max_tokens=12, ignore_eos=True)) for p in prompts]
    together = await asyncio.gather(
        *(collect(tiny_scheduler.stub, request(ids=p, max_tokens=12, ignore_eos=True)) for p in prompts)
    )
    assert [g.token_ids for g in together] == [g.token_ids for g in solo]


async def test_stop_string_and_stop_token(tiny_scheduler: Scheduler) -> None:
    base = await collect(tiny_scheduler.stub, request(ids=[5, 6, 7], max_tokens=20, ignore_eos=True))
    stop_token = base.token_ids[5]
    first = base.token_ids.index(stop_token)
    by_token = await collect(
        tiny_scheduler.stub, request(ids=[5, 6, 7], max_tokens=20, ignore_eos=True, stop_token_ids=[stop_token])
    )
    assert by_token.token_ids == base.token_ids[: first + 1]
    assert by_token.final.finish_reason == pb.FINISH_REASON_STOP
    text = base.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "need a visible stop string"
    by_string = await collect(tiny_scheduler.stub, request(ids=[5, 6, 7], max_tokens=20, ignore_eos=True, stop=[stop]))
    assert by_string.final.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE
    assert by_string.text == text[: text.index(stop)]
    assert stop not in by_string.text


async def test_max_tokens_zero_runs_to_the_end_of_the_context(tiny_scheduler: Scheduler) -> None:
    max_len = tiny_scheduler.engine.limits.max_model_len
    gen = await collect(tiny_scheduler.stub, request(ids=[9] * (max_len - 5), max_tokens=0, ignore_eos=True))
    assert len(gen.token_ids) == 5
    assert gen.final.finish_reason == pb.FINISH_REASON_CONTEXT_LENGTH


@pytest.mark.parametrize(
    ("fields", "field_named"),
    [
        (dict(prompt=""), "prompt"),
        (dict(prompt="hi", ids=[1, 2]), "prompt"),
        (dict(ids=[1, 49152]), "prompt_token_ids[1]"),
        (dict(ids=[1], temperature=math.nan), "sampling.temperature"),
        (dict(ids=[1], temperature=-0.5), "sampling.temperature"),
        (dict(ids=[1], top_p=1.5), "sampling.top_p"),
        (dict(ids=[1], top_p=-0.1), "sampling.top_p"),
        (dict(ids=[1], top_p=math.nan), "sampling.top_p"),
        (dict(ids=[1] * 500, max_tokens=13), "stopping.max_tokens"),
        (dict(ids=[1] * 512, max_tokens=0), "prompt"),
        (dict(ids=[1], stop_token_ids=[10**6]), "stopping.stop_token_ids[0]"),
        (dict(ids=[1], stop=["ok", ""]), "stopping.stop[1]"),
    ],
)
async def test_bad_input_is_invalid_argument_naming_the_field(
    tiny_scheduler: Scheduler, fields: dict[str, object], field_named: str
) -> None:
    args = dict(fields)
    prompt = str(args.pop("prompt", ""))
    ids = args.pop("ids", None)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(tiny_scheduler.stub, request(prompt, ids=ids, **args))  # type: ignore[arg-type]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field_named + ":"), err.value.details()


async def test_duplicate_request_id_in_flight_is_refused(tiny_scheduler: Scheduler) -> None:
    req = request(ids=[1, 2, 3], max_tokens=200, ignore_eos=True)
    req.request_id = "same-id"
    first = tiny_scheduler.stub.Generate(req)
    await first.read()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(tiny_scheduler.stub, req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in err.value.details()
    first.cancel()


async def test_cancelled_stream_frees_its_blocks_within_one_step(tiny_scheduler: Scheduler) -> None:
    engine = tiny_scheduler.engine
    call = tiny_scheduler.stub.Generate(request(ids=list(range(100, 140)), max_tokens=400, ignore_eos=True))
    for _ in range(3):
        await call.read()
    bm = first_scheduler(engine).block_manager
    assert bm.num_used_blocks > 0
    step_at_cancel = first_scheduler(engine)._next_step_id
    call.cancel()
    deadline = asyncio.get_running_loop().time() + 10
    while bm.num_used_blocks and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.001)
    assert bm.num_used_blocks == 0
    # the step in flight at cancel time may finish; the abort lands at the next boundary
    assert first_scheduler(engine)._next_step_id - step_at_cancel <= 2
    assert not first_scheduler(engine).has_work


async def test_client_deadline_aborts_the_request(tiny_scheduler: Scheduler) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect_with_timeout(tiny_scheduler, request(ids=[3, 4, 5], max_tokens=450, ignore_eos=True), 0.3)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def collect_with_timeout(s: Scheduler, req: pb.GenerateRequest, timeout: float) -> None:
    async for _ in s.stub.Generate(req, timeout=timeout):
        pass


async def test_health_and_unavailable_without_a_worker(tiny_model_dir: Path) -> None:
    s = await start_scheduler(tiny_model_dir, f"127.0.0.1:{free_port()}")  # nobody listens there
    try:
        health = health_pb2_grpc.HealthStub(s.channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
        reply = await health.Check(health_pb2.HealthCheckRequest(service="llmserve.v1.Generation"))
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(s.stub, request(ids=[1, 2], max_tokens=2))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await stop_scheduler(s)


async def test_health_serving_once_the_worker_is_ready(tiny_scheduler: Scheduler) -> None:
    health = health_pb2_grpc.HealthStub(tiny_scheduler.channel)
    reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_preemption_under_a_small_pool_keeps_outputs_exact(tiny_model_dir: Path) -> None:
    # 10 blocks of 16 tokens; each request grows to 20 + 44 = 64 tokens = 4 blocks.
    worker = start_worker(tiny_model_dir, "--num-gpu-blocks", "10")
    s = await start_scheduler(tiny_model_dir, worker.address)
    try:
        await s.wait_ready()
        prompts = [[200 + 11 * i + k for k in range(20)] for i in range(6)]
        solo = [await collect(s.stub, request(ids=p, max_tokens=44, ignore_eos=True)) for p in prompts]
        assert first_scheduler(s.engine).queues.num_preemptions == 0
        together = await asyncio.gather(
            *(collect(s.stub, request(ids=p, max_tokens=44, ignore_eos=True)) for p in prompts)
        )
        assert first_scheduler(s.engine).queues.num_preemptions > 0
        assert [g.token_ids for g in together] == [g.token_ids for g in solo]
        assert [g.text for g in together] == [g.text for g in solo]
        # A request that could never fit the pool is refused at once.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(s.stub, request(ids=[1] * 100, max_tokens=100))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        await s.wait_idle()
    finally:
        await stop_scheduler(s)
        worker.stop()


async def test_triton_backend_worker_streams_what_the_torch_backend_streams(
    tiny_model_dir: Path, tiny_scheduler: Scheduler
) -> None:
    """The worker flag end to end: Triton kernels (interpreter on CPU) behind the real services."""
    prompts = [[300 + 7 * i + k for k in range(5 + 9 * i)] for i in range(3)]
    want = [await collect(tiny_scheduler.stub, request(ids=p, max_tokens=6, ignore_eos=True)) for p in prompts]
    worker = start_worker(
        tiny_model_dir, "--num-gpu-blocks", "32", "--attention-backend", "triton", "--device", KERNEL_DEVICE
    )
    s = await start_scheduler(tiny_model_dir, worker.address)
    try:
        await s.wait_ready()
        got = await asyncio.gather(*(collect(s.stub, request(ids=p, max_tokens=6, ignore_eos=True)) for p in prompts))
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        await s.wait_idle()
    finally:
        await stop_scheduler(s)
        worker.stop()


async def test_worker_lost_mid_stream_gives_aborted_then_unavailable(tiny_model_dir: Path) -> None:
    worker = start_worker(tiny_model_dir, "--num-gpu-blocks", "64")
    s = await start_scheduler(tiny_model_dir, worker.address)
    try:
        await s.wait_ready()
        call = s.stub.Generate(request(ids=[1, 2, 3], max_tokens=450, ignore_eos=True))
        await call.read()
        worker.proc.kill()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while True:
                msg = await call.read()
                assert msg is not grpc.aio.EOF
        assert err.value.code() == grpc.StatusCode.ABORTED
        # The scheduler now has no worker: new requests are refused, nothing is held.
        with pytest.raises(grpc.aio.AioRpcError) as err2:
            await collect(s.stub, request(ids=[1, 2], max_tokens=2))
        assert err2.value.code() == grpc.StatusCode.UNAVAILABLE
        assert first_scheduler(s.engine) is None and not s.engine._streams
        from prometheus_client import generate_latest

        gauges = generate_latest(s.engine.metrics.registry).decode()
        for name in ("num_requests_running", "kv_cache_usage_perc"):
            assert f'llmserve:{name}{{model_name="tiny-llama"}} 0.0' in gauges, name
    finally:
        await stop_scheduler(s)
        worker.stop()
