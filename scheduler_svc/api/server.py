"""The scheduler service process: Generation API, health, reflection and metrics on one server.

The same port also serves the TGIS API (`fmaas.GenerationService`) and the smg gateway's engine
protocol (`vllm.grpc.engine.VllmEngine`), each an adapter over the one engine.
"""

from __future__ import annotations

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.config import RegistryConfig, SchedulerConfig, ServerConfig, TlsClientConfig
from common.grpc.auth import AuthInterceptor, is_loopback
from common.grpc.error_interceptor import ErrorInterceptor
from common.grpc.ports import EXCLUSIVE, bind, check_free, serve_http
from common.grpc.server_metrics import GrpcMetricsInterceptor
from common.grpc.tls import tls_mode
from common.model_spec import ModelSpec
from common.pb.llmserve.v1 import generation_pb2, generation_pb2_grpc, registry_pb2, registry_pb2_grpc
from scheduler_svc.api import roles, tgis_servicer, vllm_servicer
from scheduler_svc.api.generation_servicer import GenerationServicer
from scheduler_svc.api.registry_servicer import RegistryServicer
from scheduler_svc.engine.engine import Engine
from scheduler_svc.engine.metrics import SchedulerMetrics
from scheduler_svc.text.chat_template import ChatTemplate
from scheduler_svc.text.tokenizer import Tokenizer
from scheduler_svc.workers.rank_links import RankLinks
from scheduler_svc.workers.worker_client import WorkerClient
from scheduler_svc.workers.worker_registry import WorkerRegistry

log = structlog.get_logger(__name__)

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
REGISTRY_NAME = registry_pb2.DESCRIPTOR.services_by_name["Registry"].full_name


class SchedulerServer:
    """Owns the gRPC server and the engine; `start()` binds, `stop()` drains and closes."""

    def __init__(
        self,
        model_dir: str,
        worker_address: str | list[str],
        server_config: ServerConfig,
        scheduler_config: SchedulerConfig,
        step_timeout: float = 600.0,
        worker_tls: TlsClientConfig | None = None,
        health_interval: float = 5.0,
        registry_config: RegistryConfig | None = None,
    ) -> None:
        self.server_config = server_config
        self.registry_config = registry_config or RegistryConfig()
        spec = ModelSpec.from_dir(model_dir)
        self.metrics = SchedulerMetrics(spec.name)
        self.health = health.aio.HealthServicer()
        self.engine = Engine(
            spec,
            Tokenizer(model_dir),
            scheduler_config,
            # Each address is one worker group (a tensor-parallel one: its ranks, comma-separated).
            [
                _worker(a, step_timeout, worker_tls, health_interval)
                for a in ([worker_address] if isinstance(worker_address, str) else worker_address)
                if a
            ],
            metrics=self.metrics,
            on_ready=self._on_ready,
            chat_template=ChatTemplate.from_dir(model_dir),
            worker_factory=lambda addresses: _worker(",".join(addresses), step_timeout, worker_tls, health_interval),
        )
        self.registry = WorkerRegistry(
            spec.name, self.engine.attach_group, self.engine.detach_group, block_size=lambda: self.engine.block_size
        )
        # Metrics outermost: an error, a refused credential too, is counted under the status
        # code the client saw. Credentials are checked before the handler decodes anything.
        self.server = grpc.aio.server(
            options=[EXCLUSIVE, ("grpc.max_concurrent_streams", server_config.max_streams_per_connection)],
            interceptors=[
                GrpcMetricsInterceptor(self.metrics.registry),
                AuthInterceptor(server_config.auth, roles.role_of),
                ErrorInterceptor(),
            ],
            maximum_concurrent_rpcs=server_config.max_concurrent_rpcs,
        )
        generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(self.engine), self.server)
        tgis_servicer.register(self.server, self.engine)
        vllm_servicer.register(self.server, self.engine)
        registry_pb2_grpc.add_RegistryServicer_to_server(RegistryServicer(self.registry), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if server_config.reflection:
            reflection.enable_server_reflection(
                (
                    SERVICE_NAME,
                    tgis_servicer.SERVICE_NAME,
                    vllm_servicer.SERVICE_NAME,
                    REGISTRY_NAME,
                    health.SERVICE_NAME,
                    reflection.SERVICE_NAME,
                ),
                self.server,
            )
        self.port = 0
        self._announced = False

    async def _on_ready(self, ready: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME, vllm_servicer.SERVICE_NAME):
            await self.health.set(name, status)
        if ready and not self._announced and self.port:
            # The moment requests can be answered: the port listened since start(), but
            # without a ready worker group every request was UNAVAILABLE.
            self._announced = True
            cfg = self.server_config
            log.info(
                "ready",
                grpc=f"{cfg.host}:{self.port}",
                metrics=f"http://{cfg.host}:{cfg.metrics_port}/metrics" if cfg.metrics_port else None,
                groups=len(self.engine.replicas),
            )

    async def start(self) -> int:
        cfg = self.server_config
        await self._on_ready(False)
        if cfg.metrics_port:  # both ports are checked before either opens
            check_free(f"{cfg.host}:{cfg.metrics_port}", "--metrics-port")
        self.port = bind(self.server, f"{cfg.host}:{cfg.port}", cfg.tls, "--port")
        await self.server.start()
        if cfg.metrics_port:
            serve_http(self.metrics.serve, cfg.metrics_port, cfg.host, "--metrics-port")
        self.engine.start()
        self._warn_if_open(cfg)
        log.info(
            "scheduler_listening",
            host=cfg.host,
            port=self.port,
            metrics_port=cfg.metrics_port or None,
            tls=tls_mode(cfg.tls),
            reflection=cfg.reflection,
            client_keys=len(cfg.auth.api_keys) + len(cfg.auth.admin_keys),
            worker_token=cfg.auth.worker_token is not None,
        )
        return self.port

    @staticmethod
    def _warn_if_open(cfg: ServerConfig) -> None:
        """Say loudly what an address others can reach serves without credentials."""
        if is_loopback(cfg.host):
            return
        if not cfg.auth.clients_authenticated:
            log.warning(
                "serving_unauthenticated",
                host=cfg.host,
                detail="no --api-key: anyone who reaches this address can generate, load adapters and flush the cache",
            )
        if cfg.auth.worker_token is None:
            log.warning(
                "workers_unauthenticated",
                host=cfg.host,
                detail="no worker token: anyone who reaches this address can register as a worker and read prompts",
            )

    async def stop(self) -> None:
        """Drain: NOT_SERVING, new requests refused, in-flight ones get the grace period to finish."""
        await self._on_ready(False)
        await self.engine.drain(self.server_config.drain_timeout)
        await self.engine.stop()
        await self.server.stop(1.0)
        log.info("scheduler_stopped")


def _worker(
    address: str, step_timeout: float, tls: TlsClientConfig | None, health_interval: float
) -> WorkerClient | RankLinks:
    """One worker, or the ranks of a tensor-parallel group given as a comma-separated list."""
    addresses = [a.strip() for a in address.split(",") if a.strip()]
    if len(addresses) > 1:
        return RankLinks(addresses, step_timeout, tls, health_interval)
    return WorkerClient(address, step_timeout, tls, health_interval)
