"""Property-based fuzzing of every public RPC: the native API, TGIS and the gateway protocol,
and the worker plane.

Random messages built from each method's own request descriptor (tests/proto_strategies.py),
and random bytes, go to a real scheduler on a real port over the tiny model's worker. Only
documented status codes may come back, the server must stay SERVING after every call, and
once a method's examples are done every KV block must be back in the free pool.

The worker plane (the scheduler's Registry, a worker's Describe and Execute) has a worker
token on both sides: a caller without it gets UNAUTHENTICATED and nothing else, whatever it
sends; with it, random step plans get INVALID_ARGUMENT or a result, and the worker serves on.

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

from common.config import AuthConfig, SchedulerConfig, ServerConfig
from common.grpc.auth import bearer_metadata
from common.pb.fmaas import generation_pb2 as tgis_pb2
from common.pb.llmserve.v1 import generation_pb2, generation_pb2_grpc, registry_pb2, worker_pb2
from tests.conftest import Scheduler, WorkerProcess, start_worker, stop_scheduler
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


class Target:
    """A server's blocking channel and its health (a scheduler, or a worker)."""

    channel: grpc.Channel
    health: health_pb2_grpc.HealthStub


class ThreadedScheduler(Target):
    """The in-process scheduler on an event loop of its own thread, so that hypothesis's
    synchronous tests can call it with a blocking channel."""

    def __init__(self, model_dir: Path, worker_address: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.scheduler: Scheduler = self.run(_start_scheduler(model_dir, worker_address))
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


TOKEN = "fuzz-worker-token"


async def _start_scheduler(model_dir: Path, worker_address: str) -> Scheduler:
    """A scheduler with a worker token (its worker, which has none, takes any)."""
    from scheduler_svc.api.server import SchedulerServer

    server = SchedulerServer(
        str(model_dir),
        worker_address,
        ServerConfig(host="127.0.0.1", port=0, auth=AuthConfig(worker_token=TOKEN)),
        SchedulerConfig(),
        step_timeout=60.0,
    )
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return Scheduler(server, channel, generation_pb2_grpc.GenerationStub(channel), port)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tiny_worker: WorkerProcess) -> Iterator[ThreadedScheduler]:
    s = ThreadedScheduler(tiny_model_dir, tiny_worker.address)
    try:
        yield s
    finally:
        s.close()


# Streams that never end by themselves: a short look is enough.
ENDLESS = {"vllm.grpc.engine.VllmEngine.SubscribeKvEvents"}


class WorkerTarget(Target):
    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.health = health_pb2_grpc.HealthStub(self.channel)


@pytest.fixture(scope="module")
def token_worker(tiny_model_dir: Path) -> Iterator[WorkerTarget]:
    """A worker of its own with the token (in its environment, as `up` gives it), driven by
    no scheduler: the fuzzer's Execute calls are the only ones."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LLMSERVE_WORKER_TOKEN", TOKEN)
        worker = start_worker(tiny_model_dir, "--num-gpu-blocks", "64")
    target = WorkerTarget(worker.address)
    try:
        grpc.channel_ready_future(target.channel).result(timeout=120)
        _still_serving(target)
        yield target
    finally:
        target.channel.close()
        worker.stop()


def _call(
    s: Target, method: MethodDescriptor, payload: bytes, metadata: Any = (), timeout: float | None = None
) -> grpc.StatusCode:
    path = f"/{method.containing_service.full_name}/{method.name}"
    if timeout is None:
        timeout = 0.3 if method.full_name in ENDLESS else CALL_TIMEOUT
    try:
        if method.client_streaming:  # the worker's step stream: one plan, then the end of the stream
            for _ in s.channel.stream_stream(path)(iter([payload]), timeout=timeout, metadata=metadata):
                pass
        elif method.server_streaming:
            for _ in s.channel.unary_stream(path)(payload, timeout=timeout, metadata=metadata):
                pass
        else:
            s.channel.unary_unary(path)(payload, timeout=timeout, metadata=metadata)
    except grpc.RpcError as error:
        return error.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def _still_serving(s: Target) -> None:
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


WORKER_PLANE: list[MethodDescriptor] = [
    *registry_pb2.DESCRIPTOR.services_by_name["Registry"].methods,
    *worker_pb2.DESCRIPTOR.services_by_name["Worker"].methods,
]
# No credentials, a wrong token, another scheme, a token as bare metadata.
NOT_THE_TOKEN = st.sampled_from(
    [(), bearer_metadata("not-the-token"), (("authorization", f"Basic {TOKEN}"),), (("authorization", TOKEN),)]
)


@pytest.mark.parametrize("method", WORKER_PLANE, ids=lambda m: f"{m.containing_service.name}.{m.name}")
def test_the_worker_plane_answers_only_unauthenticated_without_the_token(
    server: ThreadedScheduler, token_worker: WorkerTarget, method: MethodDescriptor
) -> None:
    target: Target = server if method.containing_service.name == "Registry" else token_worker
    payloads = st.one_of(messages(method.input_type).map(lambda m: m.SerializeToString()), st.binary(max_size=64))

    @FUZZ
    @given(payload=payloads, metadata=NOT_THE_TOKEN)
    def check(payload: bytes, metadata: Any) -> None:
        code = _call(target, method, payload, metadata)
        assert code == grpc.StatusCode.UNAUTHENTICATED, f"{code.name} for {payload!r}"
        _still_serving(target)

    check()
    assert not server.scheduler.server.registry.num_pending  # nothing joined


def test_random_plans_with_the_token_are_refused_or_run(token_worker: WorkerTarget) -> None:
    execute = worker_pb2.DESCRIPTOR.services_by_name["Worker"].methods_by_name["Execute"]

    @FUZZ
    @given(plan=messages(worker_pb2.StepPlan.DESCRIPTOR))
    def check(plan: Any) -> None:
        # A step may run a forward pass: more time than the other calls get.
        code = _call(token_worker, execute, plan.SerializeToString(), bearer_metadata(TOKEN), timeout=60)
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), f"{code.name} for {plan}"
        _still_serving(token_worker)

    check()
