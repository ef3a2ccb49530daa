"""`llmserve.v1.Generation`: thin handlers (decode, call the engine, encode)."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator, Callable

import grpc
import structlog

from common.errors import InvalidArgument, Unavailable
from common.grpc import auth
from common.pb.llmserve.v1 import generation_pb2 as gen_pb
from common.pb.llmserve.v1 import generation_pb2_grpc
from scheduler_svc.api import generation_wire as wire
from scheduler_svc.engine.engine import Engine
from scheduler_svc.engine.request import GenerationRequest, check_request_id

# Caller ids accepted from metadata, echoed back and bound into every log line of the request.
ID_HEADERS = ("x-request-id", "x-correlation-id")


def trace_headers(context: grpc.aio.ServicerContext) -> dict[str, str]:
    """The caller's x-request-id / x-correlation-id metadata (both APIs echo and log them)."""
    return {k: v for k, v in (context.invocation_metadata() or ()) if k in ID_HEADERS and isinstance(v, str)}


def end_cause(context: grpc.aio.ServicerContext) -> Callable[[], str]:
    """Why a cancelled handler's caller went away: its deadline passed, or it cancelled or
    disconnected (gRPC does not tell those two apart on the server)."""

    def cause() -> str:
        remaining = context.time_remaining()
        return "deadline" if remaining is not None and remaining < 0.05 else "cancelled"

    return cause


def log_fields(headers: dict[str, str]) -> dict[str, str]:
    return {k.replace("-", "_"): v for k, v in headers.items()}


def bind_trace(headers: dict[str, str]) -> None:
    """Put the caller's ids on every log line of this call, from its first (a refusal) to
    the ErrorInterceptor's `rpc_refused` after the handler raised: bound for the rest of the
    call's task (gRPC runs each call in a task of its own, and tasks it starts copy them), not
    in a `with` block, whose exit would unbind them before the interceptor logs."""
    structlog.contextvars.bind_contextvars(**log_fields(headers))


def owned(req: GenerationRequest) -> GenerationRequest:
    """The request as the caller's (common/grpc/auth.py caller()): whose Abort reaches it, and
    whether it may take a priority below 0."""
    who = auth.caller()
    return dataclasses.replace(req, owner=who.name, privileged=who.admin)


def abort_scope() -> str | None:
    """Whose requests the caller's Abort may end: its own, or any for an admin (the gateway)."""
    who = auth.caller()
    return None if who.admin else who.name


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: gen_pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gen_pb.GenerateResponse]:
        headers = trace_headers(context)
        bind_trace(headers)
        req = wire.generation_request(request)
        check_request_id(req.request_id)  # before it becomes metadata
        # Only the request_id field is a key (unique while in flight, the handle for Abort):
        # trace headers may be shared by several calls, so they are echoed and logged, not keys.
        request_id = req.request_id or uuid.uuid4().hex
        echo = {"x-request-id": request_id, **headers}
        await context.send_initial_metadata(tuple(echo.items()))
        async for out in self._engine.generate(
            owned(dataclasses.replace(req, request_id=request_id)), end_cause(context)
        ):
            yield wire.generate_response(out)

    async def Abort(  # noqa: N802
        self, request: gen_pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> gen_pb.AbortResponse:
        return gen_pb.AbortResponse(aborted=self._engine.abort_requests(list(request.request_ids), abort_scope()))

    async def Tokenize(  # noqa: N802
        self, request: gen_pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> gen_pb.TokenizeResponse:
        engine = self._engine
        messages = tuple((m.role, m.content) for m in request.messages)
        if request.text and messages:
            raise InvalidArgument("text", "set either text or messages, not both")
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        if messages:
            ids = await engine.prompt_tokens("", (), messages, limit="max_tokenize_bytes")
        else:
            ids = await engine.tokenizer.encode_within("text", request.text, add_special, engine.limits.request)
        tokens = await engine.tokenizer.token_strings_off_loop(ids)
        return gen_pb.TokenizeResponse(token_ids=ids, tokens=tokens)

    async def Detokenize(  # noqa: N802
        self, request: gen_pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> gen_pb.DetokenizeResponse:
        limits = self._engine.limits
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        text = await self._engine.tokenizer.decode_within(request.token_ids, skip, limits.request, limits.vocab_size)
        return gen_pb.DetokenizeResponse(text=text)

    async def GetModelInfo(  # noqa: N802
        self, request: gen_pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> gen_pb.ModelInfo:
        return wire.model_info(self._engine.model_info(), paths=auth.caller().admin)

    async def GetLoad(  # noqa: N802
        self, request: gen_pb.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> gen_pb.Load:
        load = self._engine.load()
        if load is None:
            raise Unavailable("no ready worker: the service is warming up or its worker is down")
        return wire.load(load)

    async def LoadAdapter(  # noqa: N802
        self, request: gen_pb.LoadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> gen_pb.AdapterInfo:
        bind_trace(trace_headers(context))
        return wire.adapter_info(await self._engine.load_adapter_at_runtime(request.name, request.path))

    async def UnloadAdapter(  # noqa: N802
        self, request: gen_pb.UnloadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> gen_pb.UnloadAdapterResponse:
        bind_trace(trace_headers(context))
        self._engine.unload_adapter(request.name)
        return gen_pb.UnloadAdapterResponse()

    async def ListAdapters(  # noqa: N802
        self, request: gen_pb.ListAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> gen_pb.ListAdaptersResponse:
        # Server paths are for admins: a client key learns the adapters' names, not where they lie.
        return wire.adapter_list(self._engine.adapters.list(), paths=auth.caller().admin)
