"""common/grpc/auth.py: who may call what, through a real grpc.aio server on a real port.

One service of raw-bytes methods, one per call shape, each answering with the name of the
caller it sees; the interceptor gives each method its role by name.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from common.config import AuthConfig
from common.grpc import auth
from common.grpc.auth import AuthInterceptor, Caller, Role, judge

CLIENT_KEY = "client-key-123"
OTHER_KEY = "client-key-456"
ADMIN_KEY = "admin-key-789"
TOKEN = "worker-token-abc"
ROLES = {"Open": Role.OPEN, "Client": Role.CLIENT, "Admin": Role.ADMIN, "Worker": Role.WORKER, "Stream": Role.CLIENT}


def _role_of(method: str) -> Role:
    return ROLES[method.rsplit("/", 1)[1]]


async def _who(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    me = auth.caller()
    return f"{me.name}:{me.admin}".encode()


async def _who_streaming(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    async for _ in requests:
        me = auth.caller()
        yield f"{me.name}:{me.admin}".encode()


async def _serve(config: AuthConfig, trusted: Caller | None = None) -> tuple[grpc.aio.Server, int]:
    handlers = {name: grpc.unary_unary_rpc_method_handler(_who) for name in ("Open", "Client", "Admin", "Worker")}
    handlers["Stream"] = grpc.stream_stream_rpc_method_handler(_who_streaming)
    server = grpc.aio.server(interceptors=[AuthInterceptor(config, _role_of, trusted)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.S", handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def _stream(port: int, secret: str | None) -> bytes:
    """The bidi call from a blocking channel: grpc.aio's client, racing a server that ends the
    call before reading its requests, sometimes reports INTERNAL instead of the status sent."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream("/t.S/Stream")
        replies = list(call(iter([b"a", b"b"]), metadata=auth.bearer_metadata(secret), timeout=10))
    assert len(replies) == 2
    return replies[-1]


async def _call(port: int, method: str, secret: str | None) -> tuple[grpc.StatusCode, str]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            if method == "Stream":
                reply = await asyncio.to_thread(_stream, port, secret)
            else:
                reply = await channel.unary_unary(f"/t.S/{method}")(b"", metadata=auth.bearer_metadata(secret))
        except grpc.RpcError as error:  # the aio error, or the blocking channel's
            return error.code(), error.details() or ""
        return grpc.StatusCode.OK, reply.decode()


KEYS = AuthConfig(api_keys=(CLIENT_KEY, OTHER_KEY), admin_keys=(ADMIN_KEY,), worker_token=TOKEN)


@pytest.mark.parametrize(
    ("method", "secret", "code"),
    [
        ("Open", None, grpc.StatusCode.OK),
        ("Client", None, grpc.StatusCode.UNAUTHENTICATED),
        ("Client", "not-a-key-at-all", grpc.StatusCode.UNAUTHENTICATED),
        ("Client", TOKEN, grpc.StatusCode.UNAUTHENTICATED),  # the worker token is no client key
        ("Client", CLIENT_KEY, grpc.StatusCode.OK),
        ("Client", ADMIN_KEY, grpc.StatusCode.OK),
        ("Admin", CLIENT_KEY, grpc.StatusCode.PERMISSION_DENIED),
        ("Admin", ADMIN_KEY, grpc.StatusCode.OK),
        ("Admin", None, grpc.StatusCode.UNAUTHENTICATED),
        ("Worker", None, grpc.StatusCode.UNAUTHENTICATED),
        ("Worker", CLIENT_KEY, grpc.StatusCode.UNAUTHENTICATED),  # nor a client key a worker token
        ("Worker", TOKEN, grpc.StatusCode.OK),
        ("Stream", None, grpc.StatusCode.UNAUTHENTICATED),
        ("Stream", CLIENT_KEY, grpc.StatusCode.OK),
    ],
)
async def test_each_role_admits_only_its_secret(method: str, secret: str | None, code: grpc.StatusCode) -> None:
    server, port = await _serve(KEYS)
    try:
        got, _ = await _call(port, method, secret)
        assert got == code
    finally:
        await server.stop(None)


async def test_the_handler_sees_who_called_and_keys_are_named_not_shown() -> None:
    server, port = await _serve(KEYS)
    try:
        one = await _call(port, "Client", CLIENT_KEY)
        other = await _call(port, "Client", OTHER_KEY)
        admin = await _call(port, "Stream", ADMIN_KEY)
        assert one == (grpc.StatusCode.OK, f"{auth.key_name(CLIENT_KEY)}:False")
        assert other[1] == f"{auth.key_name(OTHER_KEY)}:False" and other[1] != one[1]
        assert admin == (grpc.StatusCode.OK, f"{auth.key_name(ADMIN_KEY)}:True")
        assert CLIENT_KEY not in one[1]
        # A refusal says how to authenticate, and nothing about the keys.
        code, message = await _call(port, "Client", "wrong-key-000")
        assert code is grpc.StatusCode.UNAUTHENTICATED and "Bearer" in message and CLIENT_KEY not in message
    finally:
        await server.stop(None)


async def test_without_keys_everyone_is_the_anonymous_admin_and_workers_need_no_token() -> None:
    server, port = await _serve(AuthConfig())
    try:
        assert await _call(port, "Admin", None) == (grpc.StatusCode.OK, "anonymous:True")
        assert (await _call(port, "Worker", None))[0] is grpc.StatusCode.OK
    finally:
        await server.stop(None)


async def test_a_trusted_listener_names_every_caller_itself() -> None:
    server, port = await _serve(KEYS, trusted=Caller("gateway", admin=True))
    try:
        assert await _call(port, "Admin", None) == (grpc.StatusCode.OK, "gateway:True")
    finally:
        await server.stop(None)


def test_api_keys_are_admin_keys_when_no_admin_key_is_set() -> None:
    one_key = AuthConfig(api_keys=(CLIENT_KEY,))
    verdict = judge(one_key, Role.ADMIN, CLIENT_KEY)
    assert verdict.caller is not None and verdict.caller.admin


def test_the_scheme_is_case_insensitive_and_other_headers_are_ignored() -> None:
    assert auth.presented([("authorization", "bearer abc")]) == "abc"
    assert auth.presented([("authorization", "Basic abc")]) is None
    assert auth.presented([("x-authorization", "Bearer abc")]) is None
    assert auth.presented(None) is None


@pytest.mark.parametrize("secret", ["short", "has space inside", "naïve-unicode-key"])
def test_weak_or_unsendable_secrets_are_refused_at_configuration(secret: str) -> None:
    with pytest.raises(ValueError, match="API key"):
        AuthConfig(api_keys=(secret,))


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("unix:///tmp/x.sock", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
    ],
)
def test_loopback_addresses(host: str, loopback: bool) -> None:
    assert auth.is_loopback(host) is loopback


def test_keys_come_from_flags_files_and_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from llmserve.cli import configs
    from llmserve.cli.parser import build_parser

    keys = tmp_path / "keys"
    keys.write_text("file-key-0001\n\nfile-key-0002\n")
    token = tmp_path / "token"
    token.write_text("token-from-file\n")
    monkeypatch.setenv("LLMSERVE_API_KEY", "env-key-0001, env-key-0002")
    monkeypatch.setenv("LLMSERVE_ADMIN_API_KEY", "env-admin-001")
    monkeypatch.setenv("LLMSERVE_WORKER_TOKEN", "token-from-env")
    a = build_parser().parse_args(
        ["scheduler", "--api-key", "flag-key-0001", "--api-key-file", str(keys), "--worker-token-file", str(token)]
    )
    config = configs.auth_config(a)
    assert config.api_keys == ("flag-key-0001", "file-key-0001", "file-key-0002", "env-key-0001", "env-key-0002")
    assert config.admin_keys == ("env-admin-001",)
    assert config.worker_token == "token-from-file"  # the file wins over the environment
    a = build_parser().parse_args(["scheduler"])
    assert configs.auth_config(a).worker_token == "token-from-env"
    monkeypatch.delenv("LLMSERVE_WORKER_TOKEN")
    assert configs.auth_config(a).worker_token is None
    with pytest.raises(ValueError, match="cannot read"):
        configs.auth_config(build_parser().parse_args(["scheduler", "--api-key-file", str(tmp_path / "missing")]))


def test_client_keys_without_a_worker_token_close_the_worker_plane() -> None:
    verdict = judge(AuthConfig(api_keys=(CLIENT_KEY,)), Role.WORKER, None)
    assert verdict.caller is None and verdict.code is grpc.StatusCode.UNAUTHENTICATED
    assert "--worker-token-file" in verdict.message


def test_secrets_stay_out_of_reprs() -> None:
    from common.config import ServerConfig

    shown = repr(ServerConfig(auth=KEYS))
    assert not [s for s in (CLIENT_KEY, OTHER_KEY, ADMIN_KEY, TOKEN) if s in shown]


def test_only_the_health_check_stays_open_on_a_keyed_scheduler() -> None:
    from scheduler_svc.api.roles import role_of
    from worker_svc.service.server import role_of as worker_role_of

    assert role_of("/grpc.health.v1.Health/Check") is Role.OPEN
    # Long-lived streams anyone could hold open to fill the server's RPC slots.
    assert role_of("/grpc.health.v1.Health/Watch") is Role.CLIENT
    assert role_of("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo") is Role.CLIENT
    assert worker_role_of("/grpc.health.v1.Health/Check") is Role.OPEN
    assert worker_role_of("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo") is Role.WORKER


async def test_a_refused_call_is_never_decoded_and_writing_handlers_still_stream() -> None:
    decoded: list[bytes] = []

    def decode(data: bytes) -> bytes:
        decoded.append(data)
        return data

    async def writes(request: bytes, context: grpc.aio.ServicerContext) -> None:
        # The shape of grpc's own Health.Watch: a coroutine that writes its responses.
        await context.write(auth.caller().name.encode())
        await context.write(b"done")

    handlers = {"Watch": grpc.unary_stream_rpc_method_handler(writes, request_deserializer=decode)}
    server = grpc.aio.server(interceptors=[AuthInterceptor(KEYS, lambda m: Role.CLIENT)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.W", handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            watch = channel.unary_stream("/t.W/Watch")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                _ = [r async for r in watch(b"x" * 1000)]
            assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED and decoded == []
            replies = [r async for r in watch(b"y", metadata=auth.bearer_metadata(CLIENT_KEY))]
            assert replies == [auth.key_name(CLIENT_KEY).encode(), b"done"] and decoded == [b"y"]
    finally:
        await server.stop(None)


def test_a_key_variable_set_empty_is_a_mistake_not_no_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    from llmserve.cli import configs
    from llmserve.cli.parser import build_parser

    monkeypatch.setenv("LLMSERVE_API_KEY", " , ")
    with pytest.raises(ValueError, match="LLMSERVE_API_KEY is set but holds no key"):
        configs.auth_config(build_parser().parse_args(["scheduler"]))
