"""The worker plane, attacked: workers and the scheduler show each other the worker token, and
everything a worker reports is bounded and checked before the scheduler acts on it.

A real scheduler (SchedulerServer on a real port, with a worker token) serves one real worker
process, which registered with the token. Against them, plain gRPC clients and fake workers
(an in-process Worker service that records every call it gets) play the attacker: without the
token nobody registers, describes or drives a worker; with it, impossible numbers or tokens
get the fake refused or lost, and the real group serves on with its limits unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import psutil
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common import worker_wire
from common.config import AuthConfig, RegistryConfig, SchedulerConfig, ServerConfig
from common.grpc.auth import bearer_metadata
from common.pb.llmserve.v1 import generation_pb2_grpc, registry_pb2_grpc, worker_pb2, worker_pb2_grpc
from common.pb.llmserve.v1 import registry_pb2 as reg_pb
from common.plan import StepResult
from common.worker_info import WorkerInfo
from tests.conftest import REPO, collect, free_port, llmserve_command, request

TOKEN = "worker-plane-test-token"
MODEL = "tiny-llama"
VOCAB = 49152
# What a sane fake worker reports: the tiny model, more room than the real worker (the router
# sends it requests first), the real worker's block size.
SANE = WorkerInfo(MODEL, VOCAB, 512, "float32", "cpu", 0, 1, 16, 4096, 0, block_bytes=8192)
PROMPT = request(ids=[5, 6, 7], max_tokens=6, ignore_eos=True)


async def until(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.05)


def worker_process(model_dir: Path, address: str, scheduler_port: int, token: str) -> subprocess.Popen[bytes]:
    """A real worker that registers with the scheduler; the token in its environment, as `up` does."""
    cmd = llmserve_command(
        "worker", model_dir, "--listen", address, "--num-gpu-blocks", "64", "--scheduler", f"127.0.0.1:{scheduler_port}"
    )
    return subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "LLMSERVE_WORKER_TOKEN": token})


@dataclass
class Plane:
    server: Any  # SchedulerServer
    worker: subprocess.Popen[bytes]
    worker_address: str  # also its group's name
    generate: generation_pb2_grpc.GenerationStub

    @property
    def engine(self) -> Any:
        return self.server.engine


async def _scheduler(model_dir: Path, registry: RegistryConfig | None = None) -> Any:
    from scheduler_svc.api.server import SchedulerServer

    server = SchedulerServer(
        str(model_dir),
        "",
        ServerConfig(port=0, auth=AuthConfig(worker_token=TOKEN)),
        SchedulerConfig(),
        step_timeout=60.0,
        registry_config=registry,
    )
    await server.start()
    return server


@pytest.fixture(scope="module")
async def plane(tiny_model_dir: Path) -> AsyncIterator[Plane]:
    server = await _scheduler(tiny_model_dir)
    address = f"127.0.0.1:{free_port()}"
    worker = worker_process(tiny_model_dir, address, server.port, TOKEN)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        await until(lambda: server.engine.ready or worker.poll() is not None, timeout=180)
        assert worker.poll() is None, "the worker exited"
        yield Plane(server, worker, address, generation_pb2_grpc.GenerationStub(channel))
    finally:
        await channel.close()
        await server.stop()
        worker.terminate()
        worker.wait(30)


async def serves_unchanged(plane: Plane, reference: list[int] | None = None) -> list[int]:
    """The real group alone serves, its limits as the model's, and a generation completes."""
    await until(lambda: len(plane.engine.replicas) == 1, timeout=30)
    assert plane.engine.replicas[0].name == plane.worker_address
    assert plane.engine.limits.max_model_len == 512
    tokens = (await collect(plane.generate, PROMPT)).token_ids
    assert len(tokens) == 6 and all(0 <= t < VOCAB for t in tokens)
    if reference is not None:
        assert tokens == reference
    return tokens


# ---- fake workers and registrations ----


class _Recorder(grpc.aio.ServerInterceptor):
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if not details.method.startswith("/grpc.health."):
            self.calls.append(details.method.rsplit("/", 1)[1])
        return await continuation(details)


@dataclass
class FakeWorker(worker_pb2_grpc.WorkerServicer):
    """A Worker endpoint that answers Describe with `info` and every plan with `bad_token` for
    each sampled row; it records every call (health aside) and every plan."""

    info: WorkerInfo = SANE
    bad_token: int = VOCAB + 7
    calls: list[str] = field(default_factory=list)
    plans: int = 0
    port: int = 0
    server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> FakeWorker:
        self.server = grpc.aio.server(interceptors=[_Recorder(self.calls)])
        worker_pb2_grpc.add_WorkerServicer_to_server(self, self.server)
        serving = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(serving, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        await serving.set("", health_pb2.HealthCheckResponse.SERVING)
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)

    async def Describe(self, request: Any, context: Any) -> worker_pb2.WorkerInfo:  # noqa: N802
        return worker_wire.encode_worker_info(self.info)

    async def Execute(self, request_iterator: Any, context: Any) -> AsyncIterator[worker_pb2.StepResult]:  # noqa: N802
        async for msg in request_iterator:
            plan = worker_wire.decode_plan(msg)
            self.plans += 1
            tokens = np.where(plan.sample == 1, self.bad_token, -1).astype(np.int32)
            yield worker_wire.encode_result(StepResult(plan.step_id, tokens))


@contextlib.asynccontextmanager
async def registration(
    port: int, address: str, group: str, token: str | None = TOKEN, **fields: Any
) -> AsyncIterator[grpc.aio.UnaryStreamCall]:
    """A Register call, as a worker rank makes it, cancelled (the rank leaving) on exit."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        msg = reg_pb.RegisterRequest(
            **{"address": address, "group": group, "world_size": 1, "model_name": MODEL, **fields}
        )
        call = registry_pb2_grpc.RegistryStub(channel).Register(msg, metadata=bearer_metadata(token))
        try:
            yield call
        finally:
            call.cancel()


async def refusal(call: grpc.aio.UnaryStreamCall) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await asyncio.wait_for(call.read(), 30)
    return error.value


# ---- without the token ----


async def test_describe_and_execute_need_the_token(plane: Plane) -> None:
    async with grpc.aio.insecure_channel(plane.worker_address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        for metadata in ((), bearer_metadata("not-the-worker-token")):
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.Describe(worker_pb2.DescribeRequest(), metadata=metadata, timeout=10)
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
            call = stub.Execute(metadata=metadata, timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await call.read()
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Probes need no token.
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    await serves_unchanged(plane)


async def test_a_fake_worker_without_the_token_is_refused_and_reaches_nothing(plane: Plane) -> None:
    fake = await FakeWorker().start()
    try:
        for token in (None, "not-the-worker-token"):
            async with registration(plane.server.port, fake.address, "fake", token) as call:
                error = await refusal(call)
                assert error.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "worker token" in (error.details() or "")
        await serves_unchanged(plane)
        assert fake.calls == [] and fake.plans == 0  # never dialed: no prompt reached it
    finally:
        await fake.stop()


# ---- with the token, reporting the impossible ----


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"num_gpu_blocks": 2**32 - 1}, "worker reports 4294967295 KV blocks, want between 1 and 4194304"),
        ({"num_gpu_blocks": 0}, "worker reports 0 KV blocks"),
        ({"num_cpu_blocks": 2**31}, "worker reports 2147483648 swap blocks"),
        ({"block_size": 12}, "KV blocks of 12 tokens, want one of 8, 16, 32, 64, 128"),
        ({"max_loras": 2**20}, "1048576 LoRA slots"),
        ({"device": "x" * 10_000}, "a device of more than 256 characters"),
        ({"max_model_len": 2}, "worker allows sequences of 2 tokens, the serving groups 512"),
        ({"block_size": 32}, "worker uses KV blocks of 32 tokens, this scheduler 16"),
        ({"vocab_size": 1000}, "worker vocabulary has 1000 tokens, the model's config says 49152"),
        ({"world_size": 2}, "worker is one of a group of 2 ranks, 1 addresses were given"),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else "",
)
async def test_a_fake_worker_reporting_the_impossible_is_refused(
    plane: Plane, changes: dict[str, Any], reason: str
) -> None:
    fake = await FakeWorker(replace(SANE, **changes)).start()
    name = f"fake-{next(iter(changes))}"
    try:
        async with registration(plane.server.port, fake.address, name) as call:
            accepted = await asyncio.wait_for(call.read(), 30)
            assert accepted.accepted  # the registration itself was in order
            refused = await asyncio.wait_for(call.read(), 60)  # then the handshake rules it out
            assert not refused.accepted
            assert f"the scheduler refused group '{name}'" in refused.message and reason in refused.message
            assert await call.read() == grpc.aio.EOF
        assert fake.calls[0] == "Describe" and fake.plans == 0  # no plan, no prompt
        await serves_unchanged(plane)
    finally:
        await fake.stop()


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({}, "rank 0 of group '{group}' is already registered (at {group})"),
        ({"world_size": 2}, "group '{group}' has 1 ranks, this rank says 2"),
        ({"block_size": 32}, "this scheduler uses KV blocks of 16 tokens, the worker 32"),
        (
            {"model_name": "another-model"},
            "this scheduler serves model 'tiny-llama', the worker serves 'another-model'",
        ),
    ],
    ids=["same-rank", "another-world-size", "another-block-size", "another-model"],
)
async def test_a_serving_groups_name_cannot_be_taken(plane: Plane, fields: dict[str, Any], reason: str) -> None:
    fake = await FakeWorker().start()
    group = plane.worker_address
    try:
        async with registration(plane.server.port, fake.address, group, **fields) as call:
            reply = await asyncio.wait_for(call.read(), 30)
            assert not reply.accepted and reason.format(group=group) in reply.message
        await serves_unchanged(plane)
        assert fake.calls == []
    finally:
        await fake.stop()


async def test_a_worker_sending_impossible_tokens_is_lost_and_its_requests_recovered(plane: Plane) -> None:
    reference = await serves_unchanged(plane)
    fake = await FakeWorker().start()
    try:
        async with registration(plane.server.port, fake.address, "liar") as call:
            assert (await asyncio.wait_for(call.read(), 30)).accepted
            await until(lambda: len(plane.engine.replicas) == 2, timeout=30)
            recovered = plane.engine.metrics.recovered._value.get()
            # The fake has the most room, so it gets the request; its tokens never reach the
            # client: it is lost, and the request is computed again on the real group.
            got = await collect(plane.generate, PROMPT)
            assert fake.plans >= 1
            assert got.token_ids == reference
            assert plane.engine.metrics.recovered._value.get() > recovered
        # The call ended, the rank left: the fake's group is gone.
        await serves_unchanged(plane, reference)
    finally:
        await fake.stop()


async def test_a_tp_groups_ranks_get_the_token_in_their_environment_not_their_argv(
    plane: Plane, tiny_model_dir: Path, tmp_path: Path
) -> None:
    token_file = tmp_path / "worker-token"
    token_file.write_text(TOKEN + "\n")
    cmd = [
        *("-m", "llmserve.cli", "--log-level", "warning", "worker", "--model", str(tiny_model_dir)),
        *("--listen", f"127.0.0.1:{free_port()}", "--dtype", "float32", "--device", "cpu", "--num-gpu-blocks", "64"),
        *("--tp", "2", "--scheduler", f"127.0.0.1:{plane.server.port}", "--worker-token-file", str(token_file)),
    ]
    env = {k: v for k, v in os.environ.items() if k != "LLMSERVE_WORKER_TOKEN"}
    launcher = subprocess.Popen([sys.executable, *cmd], cwd=REPO, env=env)
    try:
        await until(lambda: len(plane.engine.replicas) == 2 or launcher.poll() is not None, timeout=180)
        assert launcher.poll() is None, "the rank group exited"
        ranks = psutil.Process(launcher.pid).children()
        assert len(ranks) == 2
        for rank in ranks:
            assert not any(TOKEN in arg for arg in rank.cmdline())
            assert rank.environ().get("LLMSERVE_WORKER_TOKEN") == TOKEN
    finally:
        launcher.terminate()
        launcher.wait(60)
    await serves_unchanged(plane)


# ---- the step stream ----


async def test_a_second_execute_caller_is_refused_and_the_scheduler_keeps_its_group(plane: Plane) -> None:
    from worker_svc.service.servicer import STREAM_TAKEOVER_S

    reference = await serves_unchanged(plane)  # the scheduler's stream is open and serving
    async with grpc.aio.insecure_channel(plane.worker_address) as channel:
        start = time.monotonic()
        call = worker_pb2_grpc.WorkerStub(channel).Execute(metadata=bearer_metadata(TOKEN))
        second = asyncio.ensure_future(call.read())
        # Meanwhile the scheduler's stream is untouched: it generates while the intruder waits.
        await serves_unchanged(plane, reference)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await asyncio.wait_for(second, STREAM_TAKEOVER_S + 60)
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "already driven by a scheduler" in (error.value.details() or "")
        assert time.monotonic() - start >= STREAM_TAKEOVER_S - 1
    await serves_unchanged(plane, reference)


# ---- registration policy ----


async def test_no_registration_refuses_every_register(tiny_model_dir: Path) -> None:
    from worker_svc.service.registration import Registrar, RegistrationRefused

    server = await _scheduler(tiny_model_dir, RegistryConfig(enabled=False))
    fake = await FakeWorker().start()
    try:
        async with registration(server.port, fake.address, "g") as call:
            error = await refusal(call)
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "this scheduler takes no registrations (--no-registration)" in (error.details() or "")
        # A real rank's registrar gives up with the reason (the worker exits with status 2).
        registrar = Registrar(f"127.0.0.1:{server.port}", fake.address, "g", 0, 1, MODEL, token=TOKEN)
        with pytest.raises(RegistrationRefused, match="FAILED_PRECONDITION: this scheduler takes no registrations"):
            await asyncio.wait_for(registrar.run(), 30)
        assert fake.calls == []
    finally:
        await fake.stop()
        await server.stop()


async def test_the_allow_list_is_checked_before_anything_is_dialed(tiny_model_dir: Path) -> None:
    from worker_svc.service.registration import Registrar, RegistrationRefused

    server = await _scheduler(tiny_model_dir, RegistryConfig(allow=("127.0.0.1:1", "unix:///run/w.sock")))
    fake = await FakeWorker().start()
    try:
        async with registration(server.port, fake.address, "g") as call:
            error = await refusal(call)
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert f"address '{fake.address}' is not on this scheduler's worker allow-list" in (error.details() or "")
        assert fake.calls == [] and not server.engine.ready
        # The token is checked before the allow-list; a registrar without it gives up.
        registrar = Registrar(f"127.0.0.1:{server.port}", "127.0.0.1:1", "g", 0, 1, MODEL, token="a-wrong-token")
        with pytest.raises(RegistrationRefused, match="UNAUTHENTICATED"):
            await asyncio.wait_for(registrar.run(), 30)
    finally:
        await fake.stop()
        await server.stop()
    # A host entry allows any of its ports: the same fake is taken and serves.
    server = await _scheduler(tiny_model_dir, RegistryConfig(allow=("127.0.0.1",)))
    fake = await FakeWorker(bad_token=1).start()
    try:
        async with registration(server.port, fake.address, "g") as call:
            assert (await asyncio.wait_for(call.read(), 30)).accepted
            await until(lambda: server.engine.ready)
            assert fake.calls[:2] == ["Describe", "Execute"]
    finally:
        await fake.stop()
        await server.stop()


async def test_the_worker_plane_on_its_own_port_leaves_the_api_port_without_registry(tiny_model_dir: Path) -> None:
    from scheduler_svc.api.server import SchedulerServer

    registry_port = free_port()
    server = SchedulerServer(
        str(tiny_model_dir),
        "",
        ServerConfig(port=0, auth=AuthConfig(worker_token=TOKEN), registry_port=registry_port),
        SchedulerConfig(),
        step_timeout=60.0,
    )
    await server.start()
    fake = await FakeWorker(bad_token=1).start()
    try:
        assert server.registry_port == registry_port
        async with registration(server.port, fake.address, "g") as call:
            error = await refusal(call)
        assert error.code() == grpc.StatusCode.UNIMPLEMENTED  # the API port serves no Registry
        async with registration(registry_port, fake.address, "g") as call:
            assert (await asyncio.wait_for(call.read(), 30)).accepted
            await until(lambda: server.engine.ready)
            assert fake.calls[:2] == ["Describe", "Execute"]
    finally:
        await fake.stop()
        await server.stop()


def test_the_registration_flags_make_the_registry_config() -> None:
    from llmserve.cli import configs
    from llmserve.cli.parser import build_parser

    a = build_parser().parse_args(
        ["scheduler", "--no-registration", "--worker-allow", "10.0.0.1", "--worker-allow", "unix:///run/w.sock"]
    )
    assert configs.registry_config(a) == RegistryConfig(enabled=False, allow=("10.0.0.1", "unix:///run/w.sock"))
    a = build_parser().parse_args(["scheduler", "--registration-timeout", "5"])
    assert configs.registry_config(a) == RegistryConfig(join_timeout=5.0)


# ---- what a worker decodes, and what the scheduler accepts back ----


def _plan_msg(num_seqs: int = 2) -> worker_pb2.StepPlan:
    from tests.plans import Feed, make_plan

    return worker_wire.encode_plan(make_plan(1, [Feed(i, [5], 3, [i]) for i in range(num_seqs)]))


def _sparse_masks(msg: worker_pb2.StepPlan, rows: int, words: int) -> worker_pb2.StepPlan:
    """Rows that allow nothing, sent the cheap way: a byte each on the wire."""
    msg.sampling.token_mask_words = words
    msg.sampling.mask_sparse = bytes([1] * rows)
    msg.sampling.mask_id_offsets = np.zeros(rows + 1, "<i4").tobytes()
    return msg


@pytest.mark.parametrize(
    ("msg", "message"),
    [
        (_plan_msg(3), "seq_ids: 3 sequences in one step, more than this worker's 2 KV blocks"),
        # 1 byte on the wire, 64 MiB once joined (more words would be more).
        (
            _sparse_masks(_plan_msg(1), 1, 1 << 24),
            "sampling.token_mask_words: 16777216 words a row, a vocabulary of 49152 needs 1536",
        ),
        (
            _sparse_masks(_plan_msg(2), 1000, 1536),
            "sampling.token_masks: 1000 mask rows, more than the plan.s 2 positions",
        ),
    ],
    ids=["sequences", "mask-words", "mask-rows"],
)
def test_plans_no_scheduler_sends_are_refused_before_anything_is_built(msg: Any, message: str) -> None:
    worker_wire.decode_plan(_plan_msg(2), max_seqs=2, vocab_size=VOCAB)  # in bounds
    with pytest.raises(ValueError, match=message):
        worker_wire.decode_plan(msg, max_seqs=2, vocab_size=VOCAB)


async def test_plans_sent_too_far_ahead_are_refused() -> None:
    from worker_svc.service.servicer import MAX_PLANS_AHEAD, _read_plans

    sent = 0

    async def plans() -> AsyncIterator[worker_pb2.StepPlan]:
        nonlocal sent
        for _ in range(50):
            sent += 1
            yield _plan_msg(1)

    queue: asyncio.Queue[Any] = asyncio.Queue()
    await _read_plans(plans(), queue, max_seqs=64, vocab_size=VOCAB)  # nothing takes them: all pile up
    items = [queue.get_nowait() for _ in range(queue.qsize())]
    assert [i is not None and i.plan is not None for i in items] == [True] * MAX_PLANS_AHEAD + [False, False]
    assert f"more than {MAX_PLANS_AHEAD} plans sent ahead of their results" in str(items[MAX_PLANS_AHEAD].error)
    assert items[-1] is None and sent == MAX_PLANS_AHEAD + 1  # and the stream is read no further


def _asking_plan() -> Any:
    """Two sequences that sample, the first asking for 2 alternatives; and the third that does not."""
    from tests.plans import Feed, make_plan

    plan = make_plan(1, [Feed(0, [5], 3, [0]), Feed(1, [6], 3, [1]), Feed(2, [7, 8], 0, [2], sample=False)])
    return replace(plan, sampling=replace(plan.sampling, num_logprobs=np.array([2, 0, 0], np.int32)))


def _result(**changes: Any) -> StepResult:
    good = StepResult(
        1,
        np.array([3, 4, -1], np.int32),
        logprobs=np.array([-0.1, -0.2, np.nan], np.float32),
        top_token_ids=np.array([[3, 9], [-1, -1], [-1, -1]], np.int32),
        top_logprobs=np.array([[-0.1, -2.0], [-np.inf] * 2, [-np.inf] * 2], np.float32),
    )
    return replace(good, **changes)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"sampled_token_ids": np.array([VOCAB, 4, -1], np.int32)}, "a token outside the vocabulary of 49152"),
        ({"sampled_token_ids": np.array([-1, 4, -1], np.int32)}, "a token outside the vocabulary"),
        ({"sampled_token_ids": np.array([3, 4, 5], np.int32)}, "a token for a sequence that samples nothing"),
        ({"top_token_ids": np.zeros((3, 5000), np.int32)}, "5000 alternatives a row, the plan asked for 2"),
        ({"top_token_ids": np.array([[3, VOCAB + 1], [-1, -1], [-1, -1]], np.int32)}, "top_token_ids: a token outside"),
        (
            {"prompt_offsets": np.zeros(4, np.int32), "prompt_top_token_ids": np.zeros((0, 0), np.int32)},
            "prompt log-probabilities the plan did not ask for",
        ),
    ],
    ids=["token-past-vocab", "negative-token", "unasked-token", "wide-top", "top-past-vocab", "unasked-prompt"],
)
def test_results_the_plan_could_not_produce_are_refused(changes: dict[str, Any], message: str) -> None:
    worker_wire.check_result(_asking_plan(), _result(), VOCAB)  # what a worker answers
    with pytest.raises(ValueError, match=message):
        worker_wire.check_result(_asking_plan(), _result(**changes), VOCAB)


def test_prompt_scores_must_be_the_positions_the_plan_asked_for() -> None:
    plan = _asking_plan()
    # Row 2 feeds 2 prompt tokens and asks for 1 alternative: 1 position scored (no next token).
    plan = replace(
        plan,
        sampling=replace(
            plan.sampling,
            prompt_logprobs=np.array([-1, -1, 1], np.int32),
            prompt_next_token=np.array([-1, -1, -1], np.int32),
        ),
    )
    scores = {
        "prompt_logprobs": np.array([-1.0], np.float32),
        "prompt_top_token_ids": np.array([[8]], np.int32),
        "prompt_top_logprobs": np.array([[-1.0]], np.float32),
    }
    worker_wire.check_result(plan, _result(prompt_offsets=np.array([0, 0, 0, 1], np.int32), **scores), VOCAB)
    with pytest.raises(ValueError, match="not the prompt positions the plan asked to score"):
        worker_wire.check_result(plan, _result(prompt_offsets=np.array([0, 0, 0, 9], np.int32), **scores), VOCAB)
    with pytest.raises(ValueError, match="prompt_top_width: 4 alternatives, the plan asked for 1"):
        wide = {**scores, "prompt_top_token_ids": np.zeros((1, 4), np.int32)}
        worker_wire.check_result(plan, _result(prompt_offsets=np.array([0, 0, 0, 1], np.int32), **wide), VOCAB)
