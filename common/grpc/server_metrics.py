"""gRPC server metrics with the names go-grpc-prometheus made standard, for both services.

    grpc_server_started_total{grpc_type, grpc_service, grpc_method}
    grpc_server_handled_total{grpc_type, grpc_service, grpc_method, grpc_code}   (code as Go names it)
    grpc_server_msg_received_total{...}   grpc_server_msg_sent_total{...}
    grpc_server_handling_seconds{...}     (histogram)

grpc_type is unary, client_stream, server_stream or bidi_stream. The interceptor sits outside
the error interceptor, so a domain error is counted under the status code the client saw.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

_LABELS = ["grpc_type", "grpc_service", "grpc_method"]
# The label values go-grpc-prometheus uses (Go's codes.Code.String()), so dashboards match.
_GO_NAME = {
    grpc.StatusCode.OK: "OK",
    grpc.StatusCode.CANCELLED: "Canceled",
    grpc.StatusCode.UNKNOWN: "Unknown",
    grpc.StatusCode.INVALID_ARGUMENT: "InvalidArgument",
    grpc.StatusCode.DEADLINE_EXCEEDED: "DeadlineExceeded",
    grpc.StatusCode.NOT_FOUND: "NotFound",
    grpc.StatusCode.ALREADY_EXISTS: "AlreadyExists",
    grpc.StatusCode.PERMISSION_DENIED: "PermissionDenied",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "ResourceExhausted",
    grpc.StatusCode.FAILED_PRECONDITION: "FailedPrecondition",
    grpc.StatusCode.ABORTED: "Aborted",
    grpc.StatusCode.OUT_OF_RANGE: "OutOfRange",
    grpc.StatusCode.UNIMPLEMENTED: "Unimplemented",
    grpc.StatusCode.INTERNAL: "Internal",
    grpc.StatusCode.UNAVAILABLE: "Unavailable",
    grpc.StatusCode.DATA_LOSS: "DataLoss",
    grpc.StatusCode.UNAUTHENTICATED: "Unauthenticated",
}
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class GrpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, registry: CollectorRegistry) -> None:
        self.started = Counter("grpc_server_started", "RPCs started on the server.", _LABELS, registry=registry)
        self.handled = Counter(
            "grpc_server_handled",
            "RPCs completed on the server, by status code.",
            [*_LABELS, "grpc_code"],
            registry=registry,
        )
        self.received = Counter(
            "grpc_server_msg_received", "Messages received from clients.", _LABELS, registry=registry
        )
        self.sent = Counter("grpc_server_msg_sent", "Messages sent to clients.", _LABELS, registry=registry)
        self.seconds = Histogram(
            "grpc_server_handling_seconds",
            "Time from start to completion of an RPC.",
            _LABELS,
            buckets=_BUCKETS,
            registry=registry,
        )

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        service, _, method = details.method.lstrip("/").rpartition("/")
        if handler.unary_unary is not None:
            return self._wrap(handler, "unary", service, method, handler.unary_unary, False, False)
        if handler.unary_stream is not None:
            return self._wrap(handler, "server_stream", service, method, handler.unary_stream, False, True)
        if handler.stream_unary is not None:
            return self._wrap(handler, "client_stream", service, method, handler.stream_unary, True, False)
        return self._wrap(handler, "bidi_stream", service, method, handler.stream_stream, True, True)

    def _wrap(
        self,
        handler: grpc.RpcMethodHandler,
        kind: str,
        service: str,
        method: str,
        inner: Any,
        streams_in: bool,
        streams_out: bool,
    ) -> grpc.RpcMethodHandler:
        labels = (kind, service, method)
        received, sent = self.received.labels(*labels), self.sent.labels(*labels)

        def count_in(request: Any) -> Any:
            if not streams_in:
                received.inc()
                return request

            async def counted() -> AsyncIterator[Any]:
                async for message in request:
                    received.inc()
                    yield message

            return counted()

        if streams_out:

            async def stream_handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                with self._observe(labels, context):
                    async for response in inner(count_in(request), context):
                        sent.inc()
                        yield response

            make = grpc.stream_stream_rpc_method_handler if streams_in else grpc.unary_stream_rpc_method_handler
            return make(
                stream_handler,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )

        async def unary_handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with self._observe(labels, context):
                response = await inner(count_in(request), context)
                sent.inc()
                return response

        make = grpc.stream_unary_rpc_method_handler if streams_in else grpc.unary_unary_rpc_method_handler
        return make(
            unary_handler,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _observe(self, labels: tuple[str, str, str], context: grpc.aio.ServicerContext) -> _Observation:
        return _Observation(self, labels, context)


class _Observation:
    """Counts the start on entry; on exit the duration and the status code the client got."""

    def __init__(
        self, owner: GrpcMetricsInterceptor, labels: tuple[str, str, str], context: grpc.aio.ServicerContext
    ) -> None:
        self.owner, self.labels, self.context = owner, labels, context

    def __enter__(self) -> None:
        self.start = time.perf_counter()
        self.owner.started.labels(*self.labels).inc()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: object) -> None:
        if kind is None:
            code = grpc.StatusCode.OK
        elif issubclass(kind, (asyncio.CancelledError, GeneratorExit)):
            # GeneratorExit: the client went away while a streamed response was being written.
            code = grpc.StatusCode.CANCELLED
        else:
            code = self.context.code() or grpc.StatusCode.UNKNOWN
            if isinstance(code, int):  # some grpc versions report the raw integer
                code = next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
        self.owner.handled.labels(*self.labels, _GO_NAME.get(code, "Unknown")).inc()
        self.owner.seconds.labels(*self.labels).observe(time.perf_counter() - self.start)
