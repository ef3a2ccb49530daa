"""`llmserve.v1.Registry`: a worker rank's Register call lasts as long as the rank serves."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from common.pb.llmserve.v1 import registry_pb2 as reg_pb
from common.pb.llmserve.v1 import registry_pb2_grpc
from scheduler_svc.api import registry_wire as wire
from scheduler_svc.workers.worker_registry import WorkerRegistry


class RegistryServicer(registry_pb2_grpc.RegistryServicer):
    def __init__(self, registry: WorkerRegistry) -> None:
        self._registry = registry

    async def Register(  # noqa: N802 (gRPC method name)
        self, request: reg_pb.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[reg_pb.RegisterReply]:
        registration = wire.registration(request)
        problem = self._registry.join(registration)
        if problem is not None:
            yield wire.register_reply(False, problem)
            return
        try:
            yield wire.register_reply(True, f"rank {registration.rank} of group {registration.group!r} registered")
            # Held open until the worker leaves (or its connection breaks, or we stop).
            await asyncio.Event().wait()
        finally:
            self._registry.leave(registration)
