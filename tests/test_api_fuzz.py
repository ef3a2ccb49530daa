"""Property-based fuzzing of every public RPC: the native API, TGIS and the gateway protocol.

Random messages built from each method's own request descriptor (tests/proto_strategies.py),
and random bytes, go to a real scheduler on a real port over the tiny model's worker. Only
documented status codes may come back, the server must stay SERVING after every call, and
once a method's examples are done every KV block must be back in the free pool.

LLMSERVE_FUZZ_EXAMPLES sets the examples per method and input kind (20 here);
benchmarks/fuzz_api.py runs the same with many more.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import MethodDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from smg_grpc_proto.generated import vllm_engine_pb2

from common.pb.fmaas import generation_pb2 as tgis_pb2
from common.pb.llmserve.v1 import generation_pb2
from tests.conftest import Scheduler, WorkerProcess, start_scheduler, stop_scheduler
from tests.proto_strategies import messages

EXAMPLES = int(os.environ.get("LLMSERVE_FUZZ_EXAMPLES", "20"))
CALL_TIMEOUT = 3.0

# What a client may see from any public method (docs/api.md, "Errors").
DOCUMENTED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.NOT_FOUND,
}
# DEADLINE_EXCEEDED is the fuzzer's own timeout: a long generation may reach it, and the
# endless KV event stream always does. From any other method it would be a hang.
MAY_TIME_OUT = DOCUMENTED | {grpc.StatusCode.DEADLINE_EXCEEDED}


def allowed(method: MethodDescriptor) -> set[grpc.StatusCode]:
    generates = method.name.startswith("Generate")  # Generate, GenerateStream
    return MAY_TIME_OUT if generates or method.full_name in ENDLESS else DOCUMENTED


METHODS: list[MethodDescriptor] = [
    method
    for file in (generation_pb2.DESCRIPTOR, tgis_pb2.DESCRIPTOR, vllm_engine_pb2.DESCRIPTOR)
    for service in file.services_by_name.values()
    for method in service.methods
]


class ThreadedScheduler:
    """The in-process scheduler on an event loop of its own thread, so that hypothesis's
    synchronous tests can call it with a blocking channel."""

    def __init__(self, model_dir: Path, worker_address: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.scheduler: Scheduler = self.run(start_scheduler(model_dir, worker_address))
        self.run(self.scheduler.wait_ready())
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.scheduler.port}")
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.channel.close()
        self.run(stop_scheduler(self.scheduler))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tiny_worker: WorkerProcess) -> Iterator[ThreadedScheduler]:
    s = ThreadedScheduler(tiny_model_dir, tiny_worker.address)
    try:
        yield s
    finally:
        s.close()


# Streams that never end by themselves: a short look is enough.
ENDLESS = {"vllm.grpc.engine.VllmEngine.SubscribeKvEvents"}


def _call(s: ThreadedScheduler, method: MethodDescriptor, payload: bytes) -> grpc.StatusCode:
    path = f"/{method.containing_service.full_name}/{method.name}"
    timeout = 0.3 if method.full_name in ENDLESS else CALL_TIMEOUT
    try:
        if method.server_streaming:
            for _ in s.channel.unary_stream(path)(payload, timeout=timeout):
                pass
        else:
            s.channel.unary_unary(path)(payload, timeout=timeout)
    except grpc.RpcError as error:
        return error.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def _still_serving(s: ThreadedScheduler) -> None:
    status = s.health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING


FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.parametrize("method", METHODS, ids=lambda m: f"{m.containing_service.name}.{m.name}")
def test_random_messages_get_documented_statuses(server: ThreadedScheduler, method: MethodDescriptor) -> None:
    @FUZZ
    @given(request=messages(method.input_type))
    def check(request: Any) -> None:
        code = _call(server, method, request.SerializeToString())
        assert code in allowed(method), f"{code.name} for {request}"
        _still_serving(server)

    check()
    server.run(server.scheduler.wait_idle(timeout=30))


@pytest.mark.parametrize("method", METHODS, ids=lambda m: f"{m.containing_service.name}.{m.name}")
def test_random_bytes_get_documented_statuses(server: ThreadedScheduler, method: MethodDescriptor) -> None:
    @FUZZ
    @given(payload=st.binary(max_size=64))
    def check(payload: bytes) -> None:
        code = _call(server, method, payload)
        assert code in allowed(method), f"{code.name} for {payload!r}"
        _still_serving(server)

    check()
    server.run(server.scheduler.wait_idle(timeout=30))


def _near_valid() -> list[tuple[str, MethodDescriptor, Any, str]]:
    """Each generate method with a valid prompt and random generation parameters: most of
    these reach the engine and run, where whole random messages mostly stop at validation."""
    native = generation_pb2.GenerateRequest(prompt_token_ids=[5, 6, 7])
    tgis = tgis_pb2.SingleGenerationRequest(request=tgis_pb2.GenerationRequest(text="hello there"))
    gateway = vllm_engine_pb2.GenerateRequest(request_id="fuzz", text="hello there", stream=True)
    services = {m.containing_service.full_name: m.containing_service for m in METHODS}
    return [
        ("native", services["llmserve.v1.Generation"].methods_by_name["Generate"], native, "sampling,stopping"),
        ("tgis", services["fmaas.GenerationService"].methods_by_name["GenerateStream"], tgis, "params"),
        ("gateway", services["vllm.grpc.engine.VllmEngine"].methods_by_name["Generate"], gateway, "sampling_params"),
    ]


@pytest.mark.parametrize(
    ("name", "method", "base", "fields"), _near_valid(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_valid_prompts_with_random_parameters_get_documented_statuses(
    server: ThreadedScheduler, name: str, method: MethodDescriptor, base: Any, fields: str
) -> None:
    descriptor = base.DESCRIPTOR
    parts = {f: messages(descriptor.fields_by_name[f].message_type, depth=1, sparse=True) for f in fields.split(",")}

    @FUZZ
    @given(values=st.fixed_dictionaries(parts))
    def check(values: dict[str, Any]) -> None:
        request = type(base)()
        request.CopyFrom(base)
        for field, value in values.items():
            getattr(request, field).CopyFrom(value)
        code = _call(server, method, request.SerializeToString())
        assert code in allowed(method), f"{code.name} for {request}"
        _still_serving(server)

    check()
    server.run(server.scheduler.wait_idle(timeout=30))
