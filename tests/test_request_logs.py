"""Every log line of a request carries the caller's x-request-id (and x-correlation-id), on each
generation API (native, TGIS, the gateway protocol); an abort says why it came; one line says
when the scheduler is ready.

A real scheduler process logging JSON at info level; its lines are read back from stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from common.pb.fmaas import generation_pb2 as tgis
from common.pb.fmaas import generation_pb2_grpc as tgis_grpc
from common.pb.llmserve.v1 import generation_pb2 as pb
from common.pb.llmserve.v1 import generation_pb2_grpc
from tests.conftest import REPO, WorkerProcess, free_port, wait_serving

LONG, SHORT = 500, 3  # new tokens
Metadata = tuple[tuple[str, str], ...]


@dataclass
class LoggingScheduler:
    port: int
    log: Path

    def entries(self) -> list[dict[str, object]]:
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.startswith("{")]

    def lines(self, event: str, request_id: str) -> list[dict[str, object]]:
        return [e for e in self.entries() if e.get("event") == event and e.get("request_id") == request_id]

    def traced_requests(self, trace_id: str, key: str = "x_request_id") -> list[str]:
        """The request ids admitted under the caller's x-request-id (or `key`): one per TGIS prompt."""
        return [
            str(e["request_id"])
            for e in self.entries()
            if e.get("event") == "request_admitted" and e.get(key) == trace_id
        ]

    async def ended(self, event: str, x_request_id: str, count: int) -> list[dict[str, object]]:
        """The `event` line of each of the `count` requests admitted under `x_request_id`."""
        for _ in range(500):
            ids = self.traced_requests(x_request_id)
            found = [line for rid in ids for line in self.lines(event, rid)]
            if len(ids) == count and len(found) == count:
                return found
            await asyncio.sleep(0.02)
        raise AssertionError(f"no {event} line for each of {count} requests of {x_request_id}")

    def request_lines(self, trace_id: str, key: str = "x_request_id") -> list[dict[str, object]]:
        """Every line of the requests admitted under `trace_id`."""
        ids = set(self.traced_requests(trace_id, key))
        return [e for e in self.entries() if e.get("request_id") in ids]


@pytest.fixture(scope="module")
def scheduler(
    tiny_model_dir: Path, tiny_worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LoggingScheduler]:
    port = free_port()
    log = tmp_path_factory.mktemp("request-logs") / "scheduler.log"
    with log.open("a") as sink:  # appending: processes sharing it never write over each other
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "llmserve.cli",
                "--log-level",
                "info",
                "scheduler",
                "--model",
                str(tiny_model_dir),
                "--worker",
                tiny_worker.address,
                "--port",
                str(port),
            ],
            cwd=REPO,
            stdout=sink,
            stderr=sink,
            env={**os.environ, "LLMSERVE_LOG_JSON": "1"},
        )
    try:
        yield LoggingScheduler(port, log)
    finally:
        proc.terminate()
        proc.wait(30)


# ---- the generation APIs: a call of `tokens` new tokens (ignoring eos) on a prompt of `prompt` ----

_ids = itertools.count()
PROMPT, TOO_LONG = 3, 600  # the tiny model's context is 512 tokens


def native_call(channel: grpc.aio.Channel, metadata: Metadata, tokens: int, timeout: float | None, prompt: int) -> Any:
    request = pb.GenerateRequest(
        request_id=f"native-{next(_ids)}",
        prompt_token_ids=[5] * prompt,
        stopping=pb.StoppingCriteria(max_tokens=tokens, ignore_eos=True),
    )
    return generation_pb2_grpc.GenerationStub(channel).Generate(request, metadata=metadata, timeout=timeout)


def _tgis_params(tokens: int, time_limit_ms: int = 0) -> tgis.Parameters:
    stopping = tgis.StoppingCriteria(max_new_tokens=tokens, min_new_tokens=tokens, time_limit_millis=time_limit_ms)
    return tgis.Parameters(stopping=stopping)


def _text(prompt: int) -> str:
    return " ".join(["7"] * prompt)  # at least a token a word


def tgis_stream_call(
    channel: grpc.aio.Channel, metadata: Metadata, tokens: int, timeout: float | None, prompt: int
) -> Any:
    request = tgis.SingleGenerationRequest(
        request=tgis.GenerationRequest(text=_text(prompt)), params=_tgis_params(tokens)
    )
    return tgis_grpc.GenerationServiceStub(channel).GenerateStream(request, metadata=metadata, timeout=timeout)


def tgis_batch_call(
    channel: grpc.aio.Channel, metadata: Metadata, tokens: int, timeout: float | None, prompt: int
) -> Any:
    request = tgis.BatchedGenerationRequest(
        requests=[tgis.GenerationRequest(text=_text(prompt)) for _ in range(2)], params=_tgis_params(tokens)
    )
    return tgis_grpc.GenerationServiceStub(channel).Generate(request, metadata=metadata, timeout=timeout)


def gateway_call(channel: grpc.aio.Channel, metadata: Metadata, tokens: int, timeout: float | None, prompt: int) -> Any:
    request = vpb.GenerateRequest(
        request_id=f"gw-{next(_ids)}",
        tokenized=vpb.TokenizedInput(input_ids=[5] * prompt),
        sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True),
        stream=True,
    )
    return vllm_engine_pb2_grpc.VllmEngineStub(channel).Generate(request, metadata=metadata, timeout=timeout)


@dataclass(frozen=True)
class Api:
    start: Callable[[grpc.aio.Channel, Metadata, int, float | None, int], Any]
    streams: bool = True
    prompts: int = 1  # requests (and request ids) per call

    def call(
        self,
        channel: grpc.aio.Channel,
        metadata: Metadata,
        tokens: int,
        timeout: float | None = None,
        prompt: int = PROMPT,
    ) -> Any:
        return self.start(channel, metadata, tokens, timeout, prompt)


APIS = {
    "native": Api(native_call),
    "tgis-stream": Api(tgis_stream_call),
    "tgis-generate": Api(tgis_batch_call, streams=False, prompts=2),
    "gateway": Api(gateway_call),
}


@pytest.fixture(params=list(APIS))
def api(request: pytest.FixtureRequest) -> Api:
    return APIS[request.param]


@pytest.fixture
async def channel(scheduler: LoggingScheduler) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{scheduler.port}") as channel:
        await wait_serving(channel)
        yield channel


def trace(name: str) -> Metadata:
    return (("x-request-id", f"trace-{name}"), ("x-correlation-id", f"corr-{name}"))


async def until_running(scheduler: LoggingScheduler, api: Api, call: Any, x_request_id: str) -> None:
    """Until the call's requests are admitted (a stream's first message is after that)."""
    if api.streams:
        assert await call.read() is not grpc.aio.EOF
        return
    for _ in range(500):
        if len(scheduler.traced_requests(x_request_id)) == api.prompts:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the requests of {x_request_id} were not admitted")


async def consume(call: Any) -> list[Any]:
    """The call's messages (read, not iterated: a stream may have been read from already)."""
    if isinstance(call, grpc.aio.UnaryUnaryCall):
        return [await call]
    messages = []
    while (message := await call.read()) is not grpc.aio.EOF:
        messages.append(message)
    return messages


def assert_traced(scheduler: LoggingScheduler, name: str, prompts: int, ending: str) -> None:
    """Each request of the call logged its admission and its end, and every one of its lines
    carries both of the caller's ids."""
    lines = scheduler.request_lines(f"trace-{name}")
    events = [e["event"] for e in lines]
    assert events.count("request_admitted") == prompts and events.count(ending) == prompts, events
    for line in lines:
        assert line.get("x_request_id") == f"trace-{name}", line
        assert line.get("x_correlation_id") == f"corr-{name}", line


async def test_a_finished_request_logs_the_callers_ids_on_each_line(
    scheduler: LoggingScheduler, channel: grpc.aio.Channel, api: Api, request: pytest.FixtureRequest
) -> None:
    name = f"done-{request.node.callspec.id}"
    await consume(api.call(channel, trace(name), SHORT))
    await scheduler.ended("request_finished", f"trace-{name}", api.prompts)
    assert_traced(scheduler, name, api.prompts, "request_finished")
    # The ids are the call's own: nothing of them stays for the next call (here with only a
    # correlation id), on its handler's lines nor on the step loop's.
    await consume(api.call(channel, (("x-correlation-id", f"only-{name}"),), SHORT))
    for _ in range(500):
        lines = scheduler.request_lines(f"only-{name}", "x_correlation_id")
        if [e["event"] for e in lines].count("request_finished") == api.prompts:
            break
        await asyncio.sleep(0.02)
    assert [e["event"] for e in lines].count("request_finished") == api.prompts
    assert all("x_request_id" not in e and e["x_correlation_id"] == f"only-{name}" for e in lines), lines


async def test_a_refused_request_logs_the_callers_ids(
    scheduler: LoggingScheduler, channel: grpc.aio.Channel, api: Api, request: pytest.FixtureRequest
) -> None:
    """The ErrorInterceptor's rpc_refused line is the request's too (here its prompt does not fit)."""
    name = f"refused-{request.node.callspec.id}"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await consume(api.call(channel, trace(name), SHORT, prompt=TOO_LONG))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    refused = [
        e for e in scheduler.entries() if e["event"] == "rpc_refused" and e.get("x_request_id") == f"trace-{name}"
    ]
    assert len(refused) == 1 and refused[0]["x_correlation_id"] == f"corr-{name}", refused
    assert refused[0]["code"] == "INVALID_ARGUMENT"


async def test_a_deadline_is_logged_as_the_abort_reason(
    scheduler: LoggingScheduler, channel: grpc.aio.Channel, api: Api, request: pytest.FixtureRequest
) -> None:
    name = f"deadline-{request.node.callspec.id}"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await consume(api.call(channel, trace(name), LONG, 0.5))
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    aborted = await scheduler.ended("request_aborted", f"trace-{name}", api.prompts)
    assert [a["reason"] for a in aborted] == ["deadline"] * api.prompts
    assert_traced(scheduler, name, api.prompts, "request_aborted")


async def test_a_cancel_is_logged_as_the_abort_reason(
    scheduler: LoggingScheduler, channel: grpc.aio.Channel, api: Api, request: pytest.FixtureRequest
) -> None:
    name = f"cancel-{request.node.callspec.id}"
    call = api.call(channel, trace(name), LONG)
    await until_running(scheduler, api, call, f"trace-{name}")
    call.cancel()
    with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
        await consume(call)
    aborted = await scheduler.ended("request_aborted", f"trace-{name}", api.prompts)
    assert [a["reason"] for a in aborted] == ["cancelled"] * api.prompts
    assert_traced(scheduler, name, api.prompts, "request_aborted")


@pytest.mark.parametrize("api", [APIS["native"], APIS["gateway"]], ids=["native", "gateway"])
async def test_an_abort_call_is_logged_as_the_abort_reason(
    scheduler: LoggingScheduler, channel: grpc.aio.Channel, api: Api, request: pytest.FixtureRequest
) -> None:
    """The native stream then ends CANCELLED; the gateway's with "abort" completes."""
    name = f"abort-{request.node.callspec.id}"
    call = api.call(channel, trace(name), LONG)
    await until_running(scheduler, api, call, f"trace-{name}")
    [request_id] = scheduler.traced_requests(f"trace-{name}")
    if api is APIS["native"]:
        reply = await generation_pb2_grpc.GenerationStub(channel).Abort(pb.AbortRequest(request_ids=[request_id]))
        assert list(reply.aborted) == [request_id]
        with pytest.raises(grpc.aio.AioRpcError):
            await consume(call)
    else:
        await vllm_engine_pb2_grpc.VllmEngineStub(channel).Abort(vpb.AbortRequest(request_ids=[request_id]))
        last = (await consume(call))[-1]
        assert last.complete.finish_reason == "abort"
    aborted = await scheduler.ended("request_aborted", f"trace-{name}", 1)
    assert aborted[0]["reason"] == "abort_call"
    assert_traced(scheduler, name, 1, "request_aborted")


async def test_a_tgis_time_limit_is_logged_as_the_abort_reason(
    scheduler: LoggingScheduler, channel: grpc.aio.Channel
) -> None:
    """time_limit_millis aborts the request (the output ends TIME_LIMIT): neither the caller's
    deadline nor a cancel."""
    request = tgis.SingleGenerationRequest(
        request=tgis.GenerationRequest(text=_text(PROMPT)), params=_tgis_params(LONG, time_limit_ms=300)
    )
    stream = tgis_grpc.GenerationServiceStub(channel).GenerateStream(request, metadata=trace("time-limit"))
    messages = [m async for m in stream]
    assert messages[-1].stop_reason == tgis.TIME_LIMIT
    aborted = await scheduler.ended("request_aborted", "trace-time-limit", 1)
    assert aborted[0]["reason"] == "time_limit"
    assert_traced(scheduler, "time-limit", 1, "request_aborted")


async def test_one_ready_line_once_a_worker_group_is_ready(
    scheduler: LoggingScheduler, channel: grpc.aio.Channel
) -> None:
    """`scheduler_listening` comes when the port opens, seconds before anything can be
    answered; `ready` when the first worker group is, and only then."""
    events = [json.loads(line) for line in scheduler.log.read_text().splitlines() if line.startswith("{")]
    names = [e["event"] for e in events]
    assert names.count("ready") == 1, names
    ready = events[names.index("ready")]
    assert ready["grpc"] == f"127.0.0.1:{scheduler.port}" and ready["groups"] == 1
    assert names.index("scheduler_listening") < names.index("ready")
    assert names.index("worker_ready") < names.index("ready")
