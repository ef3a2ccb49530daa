"""The worker service process: load the model, allocate the KV cache, then serve steps."""

from __future__ import annotations

from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.config import WorkerConfig
from common.pb.llmserve.v1 import worker_pb2, worker_pb2_grpc
from worker_svc.runner import ModelRunner
from worker_svc.servicer import WorkerServicer

log = structlog.get_logger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
OPTIONS = [
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
]


class WorkerServer:
    def __init__(self, config: WorkerConfig, address: str, grace_seconds: float = 5.0) -> None:
        self.address = address
        self.grace_seconds = grace_seconds
        # Loading comes first: the port opens only when the worker can answer the handshake,
        # so a scheduler waiting on the channel never sees a half-ready worker.
        self.runner = ModelRunner(config)
        self.servicer = WorkerServicer(self.runner, Path(config.model).name)
        self.port = 0

    async def start(self) -> int:
        # gRPC aio objects belong to the running event loop, so they are made here.
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server(options=OPTIONS)
        worker_pb2_grpc.add_WorkerServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        self.port = self.server.add_insecure_port(self.address)
        if self.port == 0 and not self.address.startswith("unix:"):
            raise OSError(f"cannot listen on {self.address}")
        await self.server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("worker_listening", address=self.address, port=self.port)
        return self.port

    async def stop(self) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(self.grace_seconds)
        self.servicer.shutdown()
        log.info("worker_stopped")
