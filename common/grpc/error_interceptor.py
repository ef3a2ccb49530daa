"""The one place where domain errors become gRPC status codes (both services use it)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog

from common import errors

log = structlog.get_logger(__name__)

STATUS_OF: dict[type[errors.LlmserveError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.Aborted: grpc.StatusCode.ABORTED,
    errors.Unimplemented: grpc.StatusCode.UNIMPLEMENTED,
    errors.Cancelled: grpc.StatusCode.CANCELLED,
}


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """Status code and message for an exception; unknown ones become INTERNAL without details."""
    for cls in type(error).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls], str(error)
    return grpc.StatusCode.INTERNAL, "internal error (see server logs)"


async def _abort_with(context: grpc.aio.ServicerContext, error: Exception, method: str) -> None:
    code, message = status_of(error)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("rpc_failed", method=method)
    else:
        log.info("rpc_refused", method=method, code=code.name, reason=message)
    await context.abort(code, message)


class _Undecodable:
    """What a request that does not parse as its message type deserializes to."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _tolerant(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """gRPC answers a deserializer's exception with UNKNOWN ("Unexpected DecodeError"), a
    status no caller expects: the handler refuses the request instead (INVALID_ARGUMENT)."""
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as error:  # noqa: BLE001 (any parse failure is the caller's bytes)
            return _Undecodable(str(error) or type(error).__name__)

    return parse


async def _refuse_undecodable(request: Any, context: grpc.aio.ServicerContext, method: str) -> None:
    if isinstance(request, _Undecodable):
        log.info("rpc_refused", method=method, code="INVALID_ARGUMENT", reason="undecodable request")
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"the request does not parse as {method}'s message: {request.reason}"
        )


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps `LlmserveError` subclasses raised by handlers to status codes, and requests that
    do not parse to INVALID_ARGUMENT.

    Wraps unary-unary and unary-stream handlers (the shapes our public services use); the
    worker's bidi stream manages its own failures.
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await _refuse_undecodable(request, context, method)
                try:
                    return await inner_uu(request, context)
                except Exception as error:  # noqa: BLE001
                    if isinstance(error, grpc.aio.AbortError):
                        raise
                    await _abort_with(context, error, method)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary,
                request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                await _refuse_undecodable(request, context, method)
                try:
                    async for response in inner_us(request, context):
                        yield response
                except Exception as error:  # noqa: BLE001
                    if isinstance(error, grpc.aio.AbortError):
                        raise
                    await _abort_with(context, error, method)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream,
                request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        return handler
