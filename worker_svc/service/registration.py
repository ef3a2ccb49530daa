"""A worker rank's registration with its scheduler (`llmserve worker --scheduler HOST:PORT`).

The rank calls Registry.Register and holds the call open while it serves: that open call is
its membership. If the scheduler restarts or the connection breaks, the rank registers
again (with backoff); if the scheduler refuses it (another model or block size), the worker exits with the
reason, since waiting would never help. Stopping the worker ends the call first, which is
its departure: the scheduler stops sending it steps before the port closes.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc
import structlog

from common.config import TlsClientConfig
from common.grpc.tls import open_channel
from common.pb.llmserve.v1 import registry_pb2 as reg_pb
from common.pb.llmserve.v1 import registry_pb2_grpc

log = structlog.get_logger(__name__)


class RegistrationRefused(Exception):
    """The scheduler will not take this worker; the message says why."""


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
                call = registry_pb2_grpc.RegistryStub(channel).Register(request, wait_for_ready=True)
                reply = await call.read()
                if reply is grpc.aio.EOF:
                    raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "the scheduler ended the call")
                if not reply.accepted:
                    raise RegistrationRefused(reply.message)
                log.info("registered", scheduler=self.scheduler, group=self.group, rank=self.rank, address=self.address)
                backoff = 0.5
                await call.read()  # returns when the scheduler ends the call (it stopped) or the link breaks
                log.warning("registration_lost", scheduler=self.scheduler, retrying=True)
            except grpc.aio.AioRpcError as error:
                log.warning("scheduler_unreachable", scheduler=self.scheduler, reason=error.details(), retrying=True)
            finally:
                await channel.close()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10.0)
