"""`llmserve.v1.Generation`: thin handlers (decode, call the engine, encode)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from common.pb.llmserve.v1 import generation_pb2 as gen_pb
from common.pb.llmserve.v1 import generation_pb2_grpc
from scheduler_svc import wire
from scheduler_svc.engine import Engine


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: gen_pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gen_pb.GenerateResponse]:
        async for out in self._engine.generate(wire.generation_request(request)):
            yield wire.generate_response(out)
