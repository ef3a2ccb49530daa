"""Who may call what: bearer keys checked by one server interceptor (docs/design.md section 5).

Every RPC has a role: OPEN (health, reflection), WORKER (the worker plane: Register on the
scheduler, the Worker service), CLIENT (the APIs) or ADMIN (adapters, cache flush, KV events,
profiling). Credentials travel as gRPC metadata, `authorization: Bearer SECRET`, the header
vLLM's `--api-key` and OpenAI clients send over HTTP, so any gRPC client can attach it as call
metadata. The interceptor refuses a missing or wrong secret with UNAUTHENTICATED and a client
key on an admin RPC with PERMISSION_DENIED before the handler runs; the handler reads who
called through `caller()`, to scope Abort to the caller's own requests, for one.
"""

from __future__ import annotations

import contextvars
import enum
import hashlib
import hmac
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from common.config import AuthConfig

log = structlog.get_logger(__name__)

HEADER = "authorization"
_SCHEME = "bearer "


# What stays open whatever is configured: the unary health check probes call. Reflection and
# Health/Watch are long-lived streams that would let anyone hold the server's RPC slots, so on
# a server with secrets they take the role of the service they describe.
PROBE = "/grpc.health.v1.Health/Check"


class Role(enum.Enum):
    OPEN = "open"
    WORKER = "worker"
    CLIENT = "client"
    ADMIN = "admin"


@dataclass(frozen=True)
class Caller:
    """An authenticated caller. `name` identifies its key without revealing it (logs, ownership)."""

    name: str
    admin: bool


# Without client keys every caller is this one: it owns every request and may do anything,
# which is what a server on loopback with nothing configured has always allowed.
ANONYMOUS = Caller("anonymous", admin=True)
# An open RPC (health, reflection) on a server that has keys: nobody in particular.
PUBLIC = Caller("public", admin=False)
_CALLER: contextvars.ContextVar[Caller] = contextvars.ContextVar("llmserve_caller", default=ANONYMOUS)


def caller() -> Caller:
    """Who made the RPC being handled (set by AuthInterceptor for the handler's task)."""
    return _CALLER.get()


def bearer_metadata(secret: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata that presents `secret`; empty without one."""
    return () if secret is None else ((HEADER, f"Bearer {secret}"),)


def key_name(secret: str) -> str:
    """A stable, non-reversible name for a key: what logs and ownership checks use."""
    return "key-" + hashlib.sha256(secret.encode()).hexdigest()[:12]


def presented(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The bearer secret in call metadata, or None."""
    for name, value in metadata or ():
        if name == HEADER and isinstance(value, str) and value[: len(_SCHEME)].lower() == _SCHEME:
            return value[len(_SCHEME) :].strip()
    return None


def _matches(secret: str, candidates: Iterable[str]) -> bool:
    # compare_digest on every candidate: how long a refusal takes does not tell which key was near.
    found = False
    for candidate in candidates:
        found |= hmac.compare_digest(secret.encode(), candidate.encode())
    return found


def is_loopback(host: str) -> bool:
    """Whether a listen address is reachable only from this machine."""
    bare = host.strip("[]")
    return bare in ("localhost", "::1") or bare.startswith("127.") or host.startswith("unix:")


@dataclass(frozen=True)
class Verdict:
    caller: Caller | None  # None: refused
    code: grpc.StatusCode = grpc.StatusCode.OK
    message: str = ""


def judge(auth: AuthConfig, role: Role, secret: str | None) -> Verdict:
    """Whether a call of `role` presenting `secret` may proceed, and as whom."""
    if role is Role.OPEN:
        return Verdict(PUBLIC if auth.clients_authenticated else ANONYMOUS)
    if role is Role.WORKER:
        if auth.worker_token is None:
            if auth.clients_authenticated:
                # Keys for clients but none for workers would leave the back door open: a
                # registered "worker" receives every prompt routed to it.
                return Verdict(
                    None,
                    grpc.StatusCode.UNAUTHENTICATED,
                    "this server asks clients for keys but has no worker token: set --worker-token-file "
                    "(or LLMSERVE_WORKER_TOKEN) on it and its workers",
                )
            return Verdict(Caller("worker", admin=False))
        if secret is not None and _matches(secret, (auth.worker_token,)):
            return Verdict(Caller("worker", admin=False))
        return Verdict(None, grpc.StatusCode.UNAUTHENTICATED, "the worker plane needs the worker token")
    if not auth.clients_authenticated:
        return Verdict(ANONYMOUS)
    admins = auth.admin_keys or auth.api_keys
    if secret is not None and _matches(secret, admins):
        return Verdict(Caller(key_name(secret), admin=True))
    if secret is not None and _matches(secret, auth.api_keys):
        if role is Role.ADMIN:
            return Verdict(None, grpc.StatusCode.PERMISSION_DENIED, "this RPC needs an admin API key")
        return Verdict(Caller(key_name(secret), admin=False))
    missing = "no API key" if secret is None else "a wrong API key"
    return Verdict(
        None, grpc.StatusCode.UNAUTHENTICATED, f"{missing}: send `authorization: Bearer <key>` as call metadata"
    )


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks every call against `auth` by the role `role_of(method)` gives it.

    `trusted` marks a listener whose callers are known by where it listens (the gateway's port,
    which smg dials without credentials): every call there is that caller, unchecked.
    """

    def __init__(self, auth: AuthConfig, role_of: Callable[[str], Role], trusted: Caller | None = None) -> None:
        self._auth = auth
        self._role_of = role_of
        self._trusted = trusted

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        if self._trusted is not None:
            verdict = Verdict(self._trusted)
        else:
            secret = presented(handler_call_details.invocation_metadata)
            verdict = judge(self._auth, self._role_of(method), secret)
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        if verdict.caller is None:
            log.warning("rpc_unauthenticated", method=method, code=verdict.code.name)
            return _refusing(handler, verdict.code, verdict.message)
        return _as(handler, verdict.caller)


def _refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(code, message)
        yield  # pragma: no cover (abort raises)

    # No deserializer: a refused call's message is never parsed (it may be 4 MiB of anything).
    return _rebuilt(handler, refuse, refuse_stream, decode=False)


def _as(handler: grpc.RpcMethodHandler, who: Caller) -> grpc.RpcMethodHandler:
    """The handler, run with `caller()` answering `who`."""
    if who is ANONYMOUS:
        return handler

    def unary(inner: Callable[..., Any]) -> Callable[..., Any]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            _CALLER.set(who)  # the RPC's own task: the value ends with it
            return await inner(request, context)

        return call

    def streaming(inner: Callable[..., Any]) -> Callable[..., Any]:
        if not inspect.isasyncgenfunction(inner):
            # A streaming handler may also be a coroutine that writes its responses itself
            # (context.write), as grpc's own Health.Watch is.
            return unary(inner)

        async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            _CALLER.set(who)
            async for response in inner(request, context):
                yield response

        return call

    return _rebuilt(handler, None, None, unary, streaming)


def _rebuilt(
    handler: grpc.RpcMethodHandler,
    unary_behavior: Callable[..., Any] | None,
    stream_behavior: Callable[..., Any] | None,
    wrap_unary: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
    wrap_stream: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
    decode: bool = True,
) -> grpc.RpcMethodHandler:
    """A handler of the same shape and codecs whose behaviour is replaced or wrapped."""

    def behavior(inner: Callable[..., Any], streams_out: bool) -> Callable[..., Any]:
        if streams_out:
            return stream_behavior if wrap_stream is None else wrap_stream(inner)  # type: ignore[return-value]
        return unary_behavior if wrap_unary is None else wrap_unary(inner)  # type: ignore[return-value]

    codecs = {
        "request_deserializer": handler.request_deserializer if decode else None,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(behavior(handler.unary_unary, False), **codecs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(behavior(handler.unary_stream, True), **codecs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(behavior(handler.stream_unary, False), **codecs)
    return grpc.stream_stream_rpc_method_handler(behavior(handler.stream_stream, True), **codecs)
