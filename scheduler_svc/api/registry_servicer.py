"""`llmserve.v1.Registry`: a worker rank's Register call lasts as long as the rank serves.

The worker token is checked before a call gets here (common/grpc/auth.py, roles.py); what the
registration policy refuses (common/config.py RegistryConfig) comes back as a status code:
FAILED_PRECONDITION with registration off, PERMISSION_DENIED for an address off the
allow-list, INVALID_ARGUMENT for fields out of bounds, RESOURCE_EXHAUSTED with too many ranks
pending. A rank that cannot serve here (another model or block size, a taken rank) gets
`accepted: false` with the reason, as does a group the engine refuses at its handshake, later
in the call. A group that did not complete in time ends with UNAVAILABLE: register again.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from common.errors import Unavailable
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
        member = self._registry.join(registration)  # policy refusals raise, mapped to status codes
        if isinstance(member, str):
            yield wire.register_reply(False, member)
            return
        try:
            yield wire.register_reply(True, f"rank {registration.rank} of group {registration.group!r} registered")
            # Held open until the worker leaves (or its connection breaks, or we stop), or the
            # registry ends it.
            await member.ended.wait()
            ending = member.ending
            if ending is not None and ending.retry:
                raise Unavailable(ending.message)
            if ending is not None:
                yield wire.register_reply(False, ending.message)
        finally:
            self._registry.leave(member)
