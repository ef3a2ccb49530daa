"""The scheduler service process: Generation API, health, reflection and metrics on one server.

The same port also serves the TGIS API (`fmaas.GenerationService`) and the smg gateway's engine
protocol (`vllm.grpc.engine.VllmEngine`), each an adapter over the one engine. Every caller
there shows a key (common/grpc/auth.py) once keys are configured. smg cannot: it dials without
credentials. So a second listener, the gateway's, serves only its protocol (and health), and
every call there counts as the gateway (an admin); it is plaintext (smg dials h2c) and must be
bound where only the gateway reaches it: loopback under `llmserve up`, a port a network policy
keeps to the gateway's pods elsewhere.

    clients ──key──► host:port          Generation · TGIS · VllmEngine · Registry · health
    smg ──────────► gateway_host:port   VllmEngine · health          (caller: the gateway)
"""

from __future__ import annotations

import asyncio

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
from scheduler_svc.api.vllm_servicer import GATEWAY
from scheduler_svc.engine.engine import Engine
from scheduler_svc.engine.metrics import SchedulerMetrics
from scheduler_svc.text.chat_template import ChatTemplate
from scheduler_svc.text.tokenizer import Tokenizer
from scheduler_svc.workers.rank_links import RankLinks
from scheduler_svc.workers.worker_client import WorkerClient
from scheduler_svc.workers.worker_registry import WorkerRegistry

MIB = 1 << 20

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
        gateway_address: str | None = None,
        served_name: str | None = None,
    ) -> None:
        """`gateway_address` (host:port, port 0 picks one) overrides server_config's
        gateway_host/gateway_port: `llmserve up` asks for an ephemeral one on loopback.
        `served_name` is the model's name to clients (None: its directory's)."""
        self.server_config = server_config
        # A request may carry a prompt of --max-prompt-bytes as text, or as token ids (up to 5
        # bytes each on the wire, ~3 for a 50k vocabulary): gRPC's default 4 MiB would refuse a
        # million-token prompt before any limit of ours could name its flag.
        self._max_request_bytes = max(4 * MIB, 4 * scheduler_config.limits.max_prompt_bytes) + 16 * MIB
        self.registry_config = registry_config or RegistryConfig()
        spec = ModelSpec.from_dir(model_dir).served_as(served_name)
        token = server_config.auth.worker_token  # shown to every worker we dial
        self.metrics = SchedulerMetrics(spec.public_name)
        self.health = health.aio.HealthServicer()
        self.engine = Engine(
            spec,
            Tokenizer(model_dir),
            scheduler_config,
            # Each address is one worker group (a tensor-parallel one: its ranks, comma-separated).
            [
                _worker(a, step_timeout, worker_tls, health_interval, token)
                for a in ([worker_address] if isinstance(worker_address, str) else worker_address)
                if a
            ],
            metrics=self.metrics,
            on_ready=self._on_ready,
            chat_template=ChatTemplate.from_dir(model_dir),
            worker_factory=lambda addresses: _worker(
                ",".join(addresses), step_timeout, worker_tls, health_interval, token
            ),
        )
        self.registry = WorkerRegistry(
            spec.name,
            self.engine.attach_group,
            self.engine.detach_group,
            block_size=lambda: self.engine.block_size,
            config=self.registry_config,
        )
        self._rpc_metrics = GrpcMetricsInterceptor(self.metrics.registry)  # one per registry: both listeners count
        self.server = self._listener(AuthInterceptor(server_config.auth, roles.role_of))
        generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(self.engine), self.server)
        tgis_servicer.register(self.server, self.engine)
        gateway_protocol = vllm_servicer.register(self.server, self.engine)
        # The worker plane on the main port, or alone on a port of its own that a network
        # policy can keep to the workers.
        self.registry_server: grpc.aio.Server | None = None
        registry_home = self.server
        if server_config.registry_port:
            self.registry_server = registry_home = self._listener(AuthInterceptor(server_config.auth, roles.role_of))
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.registry_server)
        registry_pb2_grpc.add_RegistryServicer_to_server(RegistryServicer(self.registry), registry_home)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if server_config.reflection:
            reflection.enable_server_reflection(
                (
                    SERVICE_NAME,
                    tgis_servicer.SERVICE_NAME,
                    vllm_servicer.SERVICE_NAME,
                    *(() if self.registry_server is not None else (REGISTRY_NAME,)),
                    health.SERVICE_NAME,
                    reflection.SERVICE_NAME,
                ),
                self.server,
            )
        if gateway_address is None and server_config.gateway_port:
            gateway_address = f"{server_config.gateway_host}:{server_config.gateway_port}"
        self.gateway_address = gateway_address
        self.gateway_server: grpc.aio.Server | None = None
        if gateway_address is not None:
            self.gateway_server = self._listener(AuthInterceptor(server_config.auth, roles.role_of, trusted=GATEWAY))
            vllm_servicer.register(self.gateway_server, self.engine, gateway_protocol)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.gateway_server)
        self.port = 0
        self.gateway_port = 0  # bound by start(); 0: no gateway listener
        self.registry_port = 0  # bound by start(); 0: Registry is on the main port
        self._announced = False

    def _listener(self, auth: AuthInterceptor) -> grpc.aio.Server:
        """A gRPC server with our interceptors. Metrics outermost: an error, a refused
        credential too, is counted under the status code the client saw. Credentials are
        checked before the handler decodes anything."""
        cfg = self.server_config
        return grpc.aio.server(
            options=[
                EXCLUSIVE,
                ("grpc.max_concurrent_streams", cfg.max_streams_per_connection),
                ("grpc.max_receive_message_length", self._max_request_bytes),
            ],
            interceptors=[self._rpc_metrics, auth, ErrorInterceptor()],
            maximum_concurrent_rpcs=cfg.max_concurrent_rpcs,
        )

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
        if cfg.metrics_port:  # every port is checked before any opens
            check_free(f"{cfg.host}:{cfg.metrics_port}", "--metrics-port")
        gateway = self.gateway_address
        if gateway is not None:
            check_free(gateway, "--gateway-port")
        registry = f"{cfg.registry_host}:{cfg.registry_port}" if self.registry_server is not None else None
        if registry is not None:
            check_free(registry, "--registry-port")
        self.port = bind(self.server, f"{cfg.host}:{cfg.port}", cfg.tls, "--port")
        if self.registry_server is not None and registry is not None:
            # The same TLS as the main port: workers present the token over it.
            self.registry_port = bind(self.registry_server, registry, cfg.tls, "--registry-port")
            await self.registry_server.start()
        if self.gateway_server is not None and gateway is not None:
            # Plaintext whatever --tls-cert says: smg dials h2c.
            self.gateway_port = bind(self.gateway_server, gateway, None, "--gateway-port")
            gateway = f"{gateway.rpartition(':')[0]}:{self.gateway_port}"
            await self.gateway_server.start()
        await self.server.start()
        if cfg.metrics_port:
            serve_http(self.metrics.serve, cfg.metrics_port, cfg.host, "--metrics-port")
        self.engine.start()
        self._warn_if_open(cfg)
        if gateway is not None and not is_loopback(gateway.rpartition(":")[0]):
            log.warning(
                "gateway_port_open",
                address=gateway,
                detail="every caller of --gateway-port counts as the gateway, an admin, without a key: "
                "let only the gateway reach it (a network policy)",
            )
        log.info(
            "scheduler_listening",
            host=cfg.host,
            port=self.port,
            gateway=gateway,
            registry_port=self.registry_port or None,
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
        listeners = (self.server, self.gateway_server, self.registry_server)
        await asyncio.gather(*(s.stop(1.0) for s in listeners if s is not None))
        log.info("scheduler_stopped")


def _worker(
    address: str, step_timeout: float, tls: TlsClientConfig | None, health_interval: float, token: str | None
) -> WorkerClient | RankLinks:
    """One worker, or the ranks of a tensor-parallel group given as a comma-separated list."""
    addresses = [a.strip() for a in address.split(",") if a.strip()]
    if len(addresses) > 1:
        return RankLinks(addresses, step_timeout, tls, health_interval, token)
    return WorkerClient(address, step_timeout, tls, health_interval, token)
