"""The client plane under attack: real processes on 127.0.0.1, callers with no key, a wrong
key, another client's key, a client key where an admin one is needed.

An in-process scheduler (a real SchedulerServer on a real port, with its gateway listener) over
one LoRA-capable worker process serves most tests; a real `llmserve up` with keys serves the
HTTP ones. A worker is paused (SIGSTOP) where a request must still be in flight when another
call lands, so that no test depends on how fast this machine is.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from common.config import AuthConfig, SchedulerConfig, ServerConfig
from common.errors import InvalidArgument
from common.grpc import auth
from common.pb.fmaas import generation_pb2 as tgis_pb
from common.pb.llmserve.v1 import generation_pb2 as pb
from common.pb.llmserve.v1 import generation_pb2_grpc
from scheduler_svc.api import roles
from scheduler_svc.api.server import SchedulerServer
from scheduler_svc.api.vllm_servicer import KV_TOKEN_IDS_HEADER
from scheduler_svc.engine.engine import RUNTIME_LORA_OFF
from scheduler_svc.lora.adapter_registry import OUTSIDE_ROOT
from tests.adapters import make_peft_adapter
from tests.conftest import REPO, WorkerProcess, llmserve_command, request, start_worker

KEY_A = "client-key-aaaa1111"
KEY_B = "client-key-bbbb2222"
ADMIN = "admin-key-cccc3333"
AUTH = AuthConfig(api_keys=(KEY_A, KEY_B), admin_keys=(ADMIN,))
AUTH_CODES = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
# What an empty request must never get from a caller that may make it.
BROKEN = (*AUTH_CODES, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
APIS: list[ServiceDescriptor] = [
    pb.DESCRIPTOR.services_by_name["Generation"],
    tgis_pb.DESCRIPTOR.services_by_name["GenerationService"],
    vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"],
]
PROMPT = [1, *range(300, 340)]  # more than two KV blocks of 16


def md(key: str | None) -> tuple[tuple[str, str], ...]:
    return auth.bearer_metadata(key)


@contextmanager
def paused(worker: WorkerProcess) -> Iterator[None]:
    """No step completes meanwhile: a request in flight stays in flight."""
    worker.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        worker.proc.send_signal(signal.SIGCONT)


@pytest.fixture(scope="module")
def lora_worker(tiny_model_dir: Path) -> Iterator[WorkerProcess]:
    worker = start_worker(
        tiny_model_dir, "--num-gpu-blocks", "128", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"
    )
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def lora_root(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """root/{a,b}: adapters inside; ../outside: one outside, and root/link pointing at it."""
    base = tmp_path_factory.mktemp("client-plane")
    root = base / "root"
    root.mkdir()
    for name, seed in (("a", 1), ("b", 2)):
        make_peft_adapter(tiny_model_dir, root / name, ("q_proj", "v_proj"), rank=8, seed=seed, std=0.5)
    make_peft_adapter(tiny_model_dir, base / "outside", ("q_proj", "v_proj"), rank=8, seed=3)
    (root / "link").symlink_to(base / "outside", target_is_directory=True)
    return root


async def _ready(server: SchedulerServer, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not server.engine.ready:
        assert time.monotonic() < deadline, "the scheduler never became ready"
        await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
async def keyed(tiny_model_dir: Path, lora_worker: WorkerProcess, lora_root: Path) -> AsyncIterator[SchedulerServer]:
    """A scheduler with client and admin keys, runtime LoRA from the root, and a gateway listener."""
    server = SchedulerServer(
        str(tiny_model_dir),
        lora_worker.address,
        ServerConfig(host="127.0.0.1", port=0, auth=AUTH),
        SchedulerConfig(enable_lora=True, max_lora_rank=8, lora_root=str(lora_root), allow_runtime_lora=True),
        step_timeout=60.0,
        gateway_address="127.0.0.1:0",
    )
    await server.start()
    try:
        assert server.gateway_port and server.gateway_port != server.port
        await _ready(server)
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def main_channel(keyed: SchedulerServer) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{keyed.port}") as channel:
        yield channel


@pytest.fixture
async def gateway_channel(keyed: SchedulerServer) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{keyed.gateway_port}") as channel:
        yield channel


async def call_empty(
    channel: grpc.aio.Channel, service: ServiceDescriptor, method: MethodDescriptor, key: str | None
) -> grpc.StatusCode:
    """The status of `method` called with an empty request of its type. A stream that is still
    open once its headers came (a live subscription) counts as OK, and is cancelled."""
    cls = GetMessageClass(method.input_type)
    path = f"/{service.full_name}/{method.name}"
    if not method.server_streaming:
        try:
            await channel.unary_unary(path, request_serializer=cls.SerializeToString)(
                cls(), metadata=md(key), timeout=30
            )
        except grpc.aio.AioRpcError as error:
            return error.code()
        return grpc.StatusCode.OK
    call = channel.unary_stream(path, request_serializer=cls.SerializeToString)(cls(), metadata=md(key), timeout=30)
    await call.initial_metadata()
    try:
        return await asyncio.wait_for(call.code(), 2.0)
    except TimeoutError:
        call.cancel()
        return grpc.StatusCode.OK


def _methods() -> list[tuple[ServiceDescriptor, MethodDescriptor]]:
    return [(s, m) for s in APIS for m in s.methods]


def _admin(service: ServiceDescriptor, method: MethodDescriptor) -> bool:
    return f"/{service.full_name}/{method.name}" in roles.ADMIN_METHODS


async def test_every_rpc_of_every_api_needs_a_key(keyed: SchedulerServer, main_channel: grpc.aio.Channel) -> None:
    assert len(_methods()) > 20
    refused = {}
    for service, method in _methods():
        for key in (None, "wrong-key-0000", "admin-key-cccc333"):  # none, wrong, one character short
            code = await call_empty(main_channel, service, method, key)
            if code != grpc.StatusCode.UNAUTHENTICATED:
                refused[(method.full_name, key)] = code
    assert refused == {}, "answered without a valid key"
    # Health stays open, for probes.
    reply = await health_pb2_grpc.HealthStub(main_channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_with_a_key_every_rpc_answers_and_admin_rpcs_need_an_admin_key(
    keyed: SchedulerServer, main_channel: grpc.aio.Channel
) -> None:
    wrong = {}
    admin_methods = 0
    for service, method in _methods():
        client_code = await call_empty(main_channel, service, method, KEY_A)
        admin_code = await call_empty(main_channel, service, method, ADMIN)
        if admin_code in BROKEN:
            wrong[(method.full_name, "admin")] = admin_code
        if _admin(service, method):
            admin_methods += 1
            if client_code != grpc.StatusCode.PERMISSION_DENIED:
                wrong[(method.full_name, "client")] = client_code
        elif client_code in BROKEN:
            wrong[(method.full_name, "client")] = client_code
    assert wrong == {}
    assert admin_methods == len(roles.ADMIN_METHODS) == 6
    # And a real generation with a client key.
    stub = generation_pb2_grpc.GenerationStub(main_channel)
    out = [m async for m in stub.Generate(request(ids=PROMPT, max_tokens=4, ignore_eos=True), metadata=md(KEY_B))]
    assert sum(len(m.token_ids) for m in out) == 4 and out[-1].finish_reason == pb.FINISH_REASON_LENGTH


async def test_the_gateway_listener_serves_its_protocol_without_keys_and_nothing_else(
    keyed: SchedulerServer, gateway_channel: grpc.aio.Channel
) -> None:
    vllm = APIS[2]
    wrong = {m.name: code for m in vllm.methods if (code := await call_empty(gateway_channel, vllm, m, None)) in BROKEN}
    assert wrong == {}
    info = await vllm_engine_pb2_grpc.VllmEngineStub(gateway_channel).GetModelInfo(
        vllm_engine_pb2.GetModelInfoRequest()
    )
    assert info.model_path == keyed.engine.spec.path  # the gateway reads the tokenizer from there
    for service in APIS[:2]:
        method = service.methods_by_name["Generate"]
        assert await call_empty(gateway_channel, service, method, ADMIN) == grpc.StatusCode.UNIMPLEMENTED
    reply = await health_pb2_grpc.HealthStub(gateway_channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_a_client_key_does_not_learn_where_the_model_lies(
    keyed: SchedulerServer, main_channel: grpc.aio.Channel
) -> None:
    stub = vllm_engine_pb2_grpc.VllmEngineStub(main_channel)
    info = await stub.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest(), metadata=md(KEY_A))
    assert info.model_path == info.tokenizer_path == keyed.engine.spec.name
    admin = await stub.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest(), metadata=md(ADMIN))
    assert admin.model_path == keyed.engine.spec.path


# ---- one client's requests are its own ----


async def test_our_clients_present_their_api_key(keyed: SchedulerServer) -> None:
    from llmserve.client import AsyncLlmserveClient

    address = f"127.0.0.1:{keyed.port}"
    async with AsyncLlmserveClient(address, api_key=KEY_A) as client:
        text = await client.generate_text(prompt_token_ids=PROMPT, max_tokens=3, ignore_eos=True, timeout=60)
        assert text and (await client.tokenize("hello")).token_ids
    async with AsyncLlmserveClient(address) as client:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.model_info(timeout=10)
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED


async def _rest(call: grpc.aio.UnaryStreamCall) -> list[pb.GenerateResponse]:
    """The messages after those read (read and iteration do not mix on one call)."""
    out = []
    while (message := await call.read()) is not grpc.aio.EOF:
        out.append(message)
    return out


def _named(request_id: str, max_tokens: int = 60) -> pb.GenerateRequest:
    req = request(ids=PROMPT, max_tokens=max_tokens, ignore_eos=True)
    req.request_id = request_id
    return req


async def test_one_client_cannot_abort_anothers_request(
    keyed: SchedulerServer, main_channel: grpc.aio.Channel, lora_worker: WorkerProcess
) -> None:
    gen = generation_pb2_grpc.GenerationStub(main_channel)
    vllm = vllm_engine_pb2_grpc.VllmEngineStub(main_channel)
    streams = keyed.engine._streams
    victim = gen.Generate(_named("victim"), metadata=md(KEY_A))
    first = await victim.read()
    with paused(lora_worker):
        native = await gen.Abort(pb.AbortRequest(request_ids=["victim"]), metadata=md(KEY_B), timeout=10)
        await vllm.Abort(vllm_engine_pb2.AbortRequest(request_ids=["victim"]), metadata=md(KEY_B), timeout=10)
        stream = streams.get("victim")
        assert list(native.aborted) == [] and stream is not None and not stream.aborted
    rest = await _rest(victim)
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == 60

    # Its own, the owner aborts; an admin aborts anyone's.
    for i, (owner, aborter) in enumerate(((KEY_A, KEY_A), (KEY_B, ADMIN))):
        call = gen.Generate(_named(f"mine-{i}"), metadata=md(owner))
        await call.read()
        with paused(lora_worker):
            reply = await gen.Abort(pb.AbortRequest(request_ids=[f"mine-{i}"]), metadata=md(aborter), timeout=10)
        assert list(reply.aborted) == [f"mine-{i}"]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _rest(call)
        assert err.value.code() == grpc.StatusCode.CANCELLED


async def test_only_admins_jump_the_queue(keyed: SchedulerServer, main_channel: grpc.aio.Channel) -> None:
    gen = generation_pb2_grpc.GenerationStub(main_channel)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        _ = [m async for m in gen.Generate(request(ids=PROMPT, max_tokens=2, priority=-1), metadata=md(KEY_A))]
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert (err.value.details() or "").startswith("priority: below 0 needs an admin API key")
    for key, priority in ((ADMIN, -1), (KEY_A, 1), (KEY_A, 0)):
        out = [m async for m in gen.Generate(request(ids=PROMPT, max_tokens=2, priority=priority), metadata=md(key))]
        assert out[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED


# ---- adapters from the root ----


async def test_adapters_load_from_inside_the_root_only(
    keyed: SchedulerServer, main_channel: grpc.aio.Channel, lora_root: Path
) -> None:
    stub = generation_pb2_grpc.GenerationStub(main_channel)

    async def load(name: str, path: str, key: str = ADMIN) -> pb.AdapterInfo:
        return await stub.LoadAdapter(pb.LoadAdapterRequest(name=name, path=path), metadata=md(key), timeout=30)

    outside = lora_root.parent / "outside"
    details = set()
    for i, path in enumerate(
        (str(outside), str(lora_root / "link"), "link", "../outside", str(lora_root / "nope"), "/etc", "/etc/passwd")
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await load(f"x{i}", path)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details.add(err.value.details())
    assert details == {f"path: {OUTSIDE_ROOT}"}  # one answer, whatever lies there
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await load("in", str(lora_root / "a"), KEY_A)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert (await load("in", str(lora_root / "a"))).name == "in"
    assert (await load("rel", "b")).name == "rel"  # relative to the root
    listed = await stub.ListAdapters(pb.ListAdaptersRequest(), metadata=md(KEY_A))
    assert [a.name for a in listed.adapters] == ["in", "rel"]
    # Where they lie on the server is for admins only.
    assert [a.path for a in listed.adapters] == ["", ""]
    info = await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md(KEY_A))
    assert [a.path for a in info.adapters] == ["", ""]
    listed = await stub.ListAdapters(pb.ListAdaptersRequest(), metadata=md(ADMIN))
    assert [a.path for a in listed.adapters] == [str((lora_root / d).resolve()) for d in ("a", "b")]
    for name in ("in", "rel"):
        await stub.UnloadAdapter(pb.UnloadAdapterRequest(name=name), metadata=md(ADMIN))


@pytest.mark.parametrize("root", [True, False])
async def test_runtime_loading_is_off_unless_allowed(tiny_model_dir: Path, lora_root: Path, root: bool) -> None:
    # No worker needed: the refusal comes first.
    server = SchedulerServer(
        str(tiny_model_dir),
        [],
        ServerConfig(host="127.0.0.1", port=0),
        SchedulerConfig(enable_lora=True, max_lora_rank=8, lora_root=str(lora_root) if root else None),
    )
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.LoadAdapter(pb.LoadAdapterRequest(name="a", path=str(lora_root / "a")), timeout=30)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert err.value.details() == RUNTIME_LORA_OFF
            assert server.engine.adapters.list() == []
    finally:
        await server.stop()


def test_startup_adapters_outside_the_root_stop_the_server(tiny_model_dir: Path, lora_root: Path) -> None:
    config = SchedulerConfig(
        enable_lora=True,
        max_lora_rank=8,
        lora_root=str(lora_root),
        lora_modules=(("out", str(lora_root.parent / "outside")),),
    )
    with pytest.raises(InvalidArgument, match="LoRA root"):
        SchedulerServer(str(tiny_model_dir), [], ServerConfig(host="127.0.0.1", port=0), config)


async def test_an_adapter_loaded_again_under_its_name_never_swaps_weights_in_flight(
    keyed: SchedulerServer, main_channel: grpc.aio.Channel, lora_root: Path, lora_worker: WorkerProcess
) -> None:
    stub = generation_pb2_grpc.GenerationStub(main_channel)

    async def greedy(adapter: str) -> list[int]:
        req = request(ids=PROMPT, max_tokens=24, ignore_eos=True)
        req.adapter_id = adapter
        return [t async for m in stub.Generate(req, metadata=md(KEY_A)) for t in m.token_ids]

    async def load(name: str, path: str) -> None:
        await stub.LoadAdapter(pb.LoadAdapterRequest(name=name, path=path), metadata=md(ADMIN), timeout=30)

    async def unload(name: str) -> None:
        await stub.UnloadAdapter(pb.UnloadAdapterRequest(name=name), metadata=md(ADMIN), timeout=30)

    await load("ref-a", "a")
    await load("ref-b", "b")
    want_a, want_b = await greedy("ref-a"), await greedy("ref-b")
    assert want_a != want_b, "the adapters agree: the test could not fail"
    await unload("ref-a")
    await unload("ref-b")

    await load("x", "a")
    old = stub.Generate(
        pb.GenerateRequest(
            prompt_token_ids=PROMPT, stopping=pb.StoppingCriteria(max_tokens=24, ignore_eos=True), adapter_id="x"
        ),
        metadata=md(KEY_A),
    )
    first = await old.read()
    with paused(lora_worker):  # x's first registration is in flight while the name changes hands
        await unload("x")
        await load("x", "b")
    new = await greedy("x")  # the same prompt: no cached block of the old x may serve it
    old_tokens = [t for m in (first, *await _rest(old)) for t in m.token_ids]
    assert (old_tokens, new) == (want_a, want_b)
    await unload("x")


# ---- cache events ----


async def _stored(call: grpc.aio.UnaryStreamCall) -> list[common_pb2.KvBlock]:
    """The blocks of the first batch that stores any."""
    while True:
        batch = await asyncio.wait_for(call.read(), 30)
        blocks = [b for e in batch.events if e.WhichOneof("data") == "stored" for b in e.stored.blocks]
        if blocks:
            return blocks


async def test_cache_events_carry_token_ids_only_for_the_gateway_or_an_admin_who_asks(
    keyed: SchedulerServer, main_channel: grpc.aio.Channel, gateway_channel: grpc.aio.Channel
) -> None:
    main = vllm_engine_pb2_grpc.VllmEngineStub(main_channel)
    gateway = vllm_engine_pb2_grpc.VllmEngineStub(gateway_channel)
    subscribe = common_pb2.SubscribeKvEventsRequest()
    ask = ((KV_TOKEN_IDS_HEADER, "1"),)
    refused = main.SubscribeKvEvents(subscribe, metadata=(*md(KEY_A), *ask))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await refused.read()
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    calls = {
        "admin": main.SubscribeKvEvents(subscribe, metadata=md(ADMIN)),
        "admin asking": main.SubscribeKvEvents(subscribe, metadata=(*md(ADMIN), *ask)),
        "gateway": gateway.SubscribeKvEvents(subscribe),
    }
    for call in calls.values():
        await call.initial_metadata()  # subscribed
    prompt = [1, *range(900, 940)]  # not cached yet: stored now
    gen = generation_pb2_grpc.GenerationStub(main_channel)
    _ = [m async for m in gen.Generate(request(ids=prompt, max_tokens=1), metadata=md(KEY_B))]
    seen = {who: await _stored(call) for who, call in calls.items()}
    for call in calls.values():
        call.cancel()
    size = keyed.engine.block_size
    hashes = [b.block_hash for b in seen["gateway"]]
    assert len(hashes) == 2 and all(hashes)
    assert [b.block_hash for b in seen["admin"]] == [b.block_hash for b in seen["admin asking"]] == hashes
    assert all(b.block_size == size and not b.token_ids for b in seen["admin"])
    for who in ("admin asking", "gateway"):
        assert [list(b.token_ids) for b in seen[who]] == [prompt[:size], prompt[size : 2 * size]], who


# ---- HTTP through `llmserve up` ----


def _ports(n: int) -> list[int]:
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def _http(url: str, key: str | None = None, body: dict[str, Any] | None = None) -> tuple[int, str]:
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers, method="POST" if body is not None else "GET")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except OSError:
        return 0, ""


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                continue
    found, frontier = [pid], [pid]
    while frontier:
        kids = [p for p, parent in parents.items() if parent in frontier]
        found += kids
        frontier = kids
    return found


def _read(pid: int, what: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/{what}").read_bytes()
    except OSError:
        return b""


class Up:
    """`llmserve up` with a client and an admin key, from the environment."""

    def __init__(self, model_dir: Path) -> None:
        self.port, self.http_port, self.http_metrics_port = _ports(3)
        cmd = llmserve_command(
            "up",
            model_dir,
            "--num-gpu-blocks",
            "64",
            "--port",
            str(self.port),
            "--http-port",
            str(self.http_port),
            "--http-metrics-port",
            str(self.http_metrics_port),
        )
        env = {**os.environ, "LLMSERVE_API_KEY": KEY_A, "LLMSERVE_ADMIN_API_KEY": ADMIN}
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env)
        self.base = f"http://127.0.0.1:{self.http_port}"

    def wait_ready(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while _http(f"{self.base}/readiness")[0] != 200:
            assert self.proc.poll() is None, f"llmserve up exited with {self.proc.returncode}"
            assert time.monotonic() < deadline, "the gateway never became ready"
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def up(tiny_model_dir: Path) -> Iterator[Up]:
    server = Up(tiny_model_dir)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_http_needs_a_key_and_every_key_serves_completions(up: Up, tiny_model_dir: Path) -> None:
    body = {"model": tiny_model_dir.name, "prompt": "Hello there, how are you?", "max_tokens": 3}
    url = f"{up.base}/v1/completions"
    assert _http(url, None, body)[0] == 401
    assert _http(url, "wrong-key-0000", body)[0] == 401
    for key in (ADMIN, KEY_A):  # smg's shared key, and a tenant key
        status, text = _http(url, key, body)
        assert status == 200, text
        assert json.loads(text)["usage"]["completion_tokens"] == 3
    # smg's own admin routes take the shared (admin) key only.
    assert _http(f"{up.base}/flush_cache", KEY_A, {})[0] == 401
    assert _http(f"{up.base}/flush_cache", ADMIN, {})[0] != 401


def test_up_keeps_keys_and_the_worker_token_off_every_command_line(up: Up) -> None:
    tree = _tree(up.proc.pid)
    tokens = {
        line.split(b"=", 1)[1]
        for pid in tree
        for line in _read(pid, "environ").split(b"\0")
        if line.startswith(b"LLMSERVE_WORKER_TOKEN=")
    }
    (token,) = tokens  # the workers' (none elsewhere in the tree would be a leak too, but up made one)
    assert len(token) >= 32
    cmdlines = [_read(pid, "cmdline") for pid in tree]
    assert any(b"smg" in c for c in cmdlines) and any(b"worker" in c for c in cmdlines)
    for secret in (KEY_A.encode(), ADMIN.encode(), token):
        assert not [c for c in cmdlines if secret in c]


async def test_up_needs_the_key_on_grpc_and_smg_routes_on_the_cache_it_is_told_of(up: Up, tiny_model_dir: Path) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{up.port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert (await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md(KEY_A), timeout=30)).model_name
    # smg follows the scheduler's cache events on the gateway listener: the blocks of a long
    # prompt show up in its index (it hashes their token ids itself).
    body = {"model": tiny_model_dir.name, "prompt": " ".join(["stone river"] * 30), "max_tokens": 1}
    assert (await asyncio.to_thread(_http, f"{up.base}/v1/completions", KEY_A, body))[0] == 200
    metrics = f"http://127.0.0.1:{up.http_metrics_port}/metrics"

    def indexed() -> float:
        text = _http(metrics)[1]
        lines = [
            line for line in text.splitlines() if line.startswith(("smg_kv_index_blocks{", "smg_kv_index_blocks "))
        ]
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines)

    deadline = time.monotonic() + 30
    while await asyncio.to_thread(indexed) < 2:
        assert time.monotonic() < deadline, "smg indexed no block of the prompt"
        await asyncio.sleep(0.2)
