"""A worker rank's registration with its scheduler (`llmserve worker --scheduler HOST:PORT`).

The rank calls Registry.Register and holds the call open while it serves: that open call is
its membership. If the scheduler restarts or the connection breaks, the rank registers
again (with backoff); if the scheduler refuses it (another model or block size, a wrong or
missing worker token, registration off, an address off its allow-list, or its group refused
at the handshake, later in the call), the worker exits with the reason, since waiting would
never help. A group that did not complete in time is dropped with UNAVAILABLE, and registers
again like after a broken link. Stopping the worker ends the call first, which is its
departure: the scheduler stops sending it steps before the port closes.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
import structlog

from common.config import TlsClientConfig
from common.grpc.auth import bearer_metadata
from common.grpc.tls import open_channel
from common.pb.llmserve.v1 import registry_pb2 as reg_pb
from common.pb.llmserve.v1 import registry_pb2_grpc

log = structlog.get_logger(__name__)


class RegistrationRefused(Exception):
    """The scheduler will not take this worker; the message says why."""


# Statuses that registering again cannot change: the worker exits with them.
_FINAL = (
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.INVALID_ARGUMENT,
)


@dataclass(frozen=True)
class Registrar:
    scheduler: str  # host:port of the scheduler
    address: str  # where the scheduler reaches this rank
    group: str
    rank: int
    world_size: int
    model_name: str
    block_size: int = 0
    tls: TlsClientConfig | None = None
    # The worker token, shown on Register (never in a repr, nor so in a log line).
    token: str | None = field(default=None, repr=False)

    async def run(self) -> None:
        """Stay registered until cancelled; raises RegistrationRefused if the scheduler says no."""
        request = reg_pb.RegisterRequest(
            address=self.address,
            group=self.group,
            rank=self.rank,
            world_size=self.world_size,
            model_name=self.model_name,
            block_size=self.block_size,
        )
        backoff = 0.5
        while True:
            channel = open_channel(self.scheduler, self.tls, [])
            try:
                call = registry_pb2_grpc.RegistryStub(channel).Register(
                    request, wait_for_ready=True, metadata=bearer_metadata(self.token)
                )
                reply = await call.read()
                if reply is grpc.aio.EOF:
                    raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "the scheduler ended the call")
                if not reply.accepted:
                    raise RegistrationRefused(reply.message)
                log.info("registered", scheduler=self.scheduler, group=self.group, rank=self.rank, address=self.address)
                backoff = 0.5
                # Returns when the scheduler ends the call (it stopped, or refused the group at
                # its handshake: a reply saying so) or the link breaks.
                reply = await call.read()
                if reply is not grpc.aio.EOF and not reply.accepted:
                    raise RegistrationRefused(reply.message)
                log.warning("registration_lost", scheduler=self.scheduler, retrying=True)
            except grpc.aio.AioRpcError as error:
                if error.code() in _FINAL:
                    raise RegistrationRefused(f"{error.code().name}: {error.details()}") from error
                log.warning("scheduler_unreachable", scheduler=self.scheduler, reason=error.details(), retrying=True)
            finally:
                await channel.close()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10.0)
