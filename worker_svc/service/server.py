"""The worker service process: load the model, allocate the KV cache, then serve steps.

Describe and Execute are the worker plane (common/grpc/auth.py): with a worker token
configured, only a caller that shows it (the scheduler) gets the handshake or a step stream,
so nobody else can read prompts off the cache or feed plans; health and reflection stay open.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
from concurrent.futures import Executor
from pathlib import Path

import grpc
import structlog
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.config import AuthConfig, TlsConfig, WorkerConfig
from common.grpc.auth import PROBE, AuthInterceptor, Role, is_loopback
from common.grpc.error_interceptor import ErrorInterceptor
from common.grpc.ports import EXCLUSIVE, bind, check_free, serve_http
from common.grpc.tls import tls_mode
from common.pb.llmserve.v1 import worker_pb2, worker_pb2_grpc
from kernels.versions import require_gpu_stack
from worker_svc.device.pipeline import join
from worker_svc.device.stage_probe import choose_split
from worker_svc.service.metrics import WorkerMetrics
from worker_svc.service.registration import Registrar, RegistrationRefused
from worker_svc.service.servicer import WorkerServicer
from worker_svc.step.loader import load_config, resolve_device, resolve_dtype
from worker_svc.step.runner import ModelRunner

log = structlog.get_logger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
MIB = 1 << 20


def role_of(method: str) -> Role:
    """The health check is open (probes); everything else the port serves, reflection and
    Health/Watch included, is the worker plane."""
    return Role.OPEN if method == PROBE else Role.WORKER


_GRPC_MAX_BYTES = (1 << 31) - 1  # the most a gRPC message length option can say


def max_plan_bytes(max_num_seqs: int, max_model_len: int, block_size: int, vocab_size: int) -> int:
    """The largest step plan a scheduler sends this worker, with room to spare: its receive limit.

    Per sequence: the token history of a penalized one (4 bytes a token of its context, the
    plan's largest array by far), its block table row, a structured output's mask row, and
    the fixed per-sequence arrays, logit bias and stop-token bans (64 KiB covers 8k entries).
    Times the sequences of a step: --max-num-seqs, which `up` and the offline LLM give the
    scheduler and its workers alike, and at least the default 256, for a scheduler started on
    its own. Plus 16 MiB for the fed tokens and the block operations. SmolLM2 (8k context,
    49k vocabulary) at 256 sequences: 42 MiB, where 256 MiB was allowed before.
    """
    per_seq = 4 * max_model_len + 4 * -(-max_model_len // block_size) + 4 * -(-vocab_size // 32) + 64 * 1024
    # gRPC takes the limit as a C int: a context of ~2M tokens would pass it.
    return min(16 * MIB + max(max_num_seqs, 256) * per_seq, _GRPC_MAX_BYTES)


class WorkerServer:
    def __init__(
        self,
        config: WorkerConfig,
        address: str,
        grace_seconds: float = 5.0,
        tls: TlsConfig | None = None,
        reflection: bool = True,
        metrics_port: int = 0,
        registrar: Registrar | None = None,
        executor: Executor | None = None,
        auth: AuthConfig | None = None,
    ) -> None:
        self.address = address
        # Only the worker token matters here (Role.WORKER); a worker has no client keys.
        self.auth = auth or AuthConfig()
        self.grace_seconds = grace_seconds
        self.tls = tls
        self.reflection = reflection
        # A taken port is refused now, not after the model has loaded.
        check_free(address, "--listen")
        # Loading comes first: the port opens only when the worker can answer the handshake,
        # so a scheduler waiting on the channel never sees a half-ready worker.
        device = rank_device(resolve_device(config.device), config.rank, config.world_size, config.dist_backend)
        if device.type == "cuda":
            require_gpu_stack()  # an old torch/triton fails here in one line, not in a kernel
        text_config = load_config(config.model).get_text_config()
        tp = config.world_size // config.pipeline_stages

        def measured_split(stage: int) -> tuple[int, ...]:
            dtype = resolve_dtype(config.dtype, device)
            return choose_split(text_config, config.pipeline_stages, tp, stage, dtype, device)

        group, stage = join(
            config.rank,
            config.world_size,
            config.pipeline_stages,
            text_config.num_hidden_layers,
            config.dist_init_method,
            device,
            config.dist_timeout,
            config.dist_backend,
            config.pp_layer_split,
            measured_split if config.pp_layer_split_auto else None,
        )
        self.runner = ModelRunner(dataclasses.replace(config, device=str(device)), group, stage)
        self.metrics_port = metrics_port
        self.registrar = registrar
        self._registration: asyncio.Task[None] | None = None
        self.exit_code = 0
        self.metrics = WorkerMetrics(Path(config.model).name, config.rank)
        self.metrics.gpu_blocks.set(self.runner.kv.num_blocks)
        self.metrics.cpu_blocks.set(self.runner.kv.num_cpu_blocks)
        # Steps run on `executor` (the process's main thread, see worker_svc/service/main_thread.py).
        self.servicer = WorkerServicer(self.runner, Path(config.model).name, self.metrics, executor)
        runner = self.runner
        self.max_receive_bytes = max_plan_bytes(
            config.max_num_seqs, runner.max_model_len, runner.block_size, runner.shape.vocab_size
        )
        self.port = 0

    async def start(self) -> int:
        # gRPC aio objects belong to the running event loop, so they are made here.
        self.health = health.aio.HealthServicer()
        # Metrics outermost (a refused credential counts under the code its caller saw), then the
        # token, checked before anything is decoded; requests that do not parse are then refused
        # with INVALID_ARGUMENT rather than gRPC's UNKNOWN.
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_send_message_length", 256 * MIB),
                ("grpc.max_receive_message_length", self.max_receive_bytes),
                EXCLUSIVE,
            ],
            interceptors=[self.metrics.grpc, AuthInterceptor(self.auth, role_of), ErrorInterceptor()],
        )
        worker_pb2_grpc.add_WorkerServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if self.reflection:
            reflection.enable_server_reflection(
                (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server
            )
        # Metrics listen on the same interface as the service (loopback for a unix socket).
        host = "127.0.0.1" if self.address.startswith("unix:") else self.address.rsplit(":", 1)[0]
        if self.metrics_port:
            check_free(f"{host}:{self.metrics_port}", "--metrics-port")
        self.port = bind(self.server, self.address, self.tls, "--listen")
        await self.server.start()
        if self.metrics_port:
            serve_http(self.metrics.serve, self.metrics_port, host, "--metrics-port")
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self.registrar is not None:
            self._registration = asyncio.get_running_loop().create_task(self._stay_registered(self.registrar))
        log.info(
            "worker_listening",
            address=self.address,
            port=self.port,
            tls=tls_mode(self.tls),
            reflection=self.reflection,
            worker_token=self.auth.worker_token is not None,
            max_receive_mib=round(self.max_receive_bytes / MIB, 1),
        )
        if self.auth.worker_token is None and not is_loopback(host):
            log.warning(
                "workers_unauthenticated",
                address=self.address,
                detail="no worker token: anyone who reaches this address can drive this worker and read the prompts "
                "it computes; give the scheduler's token (--worker-token-file or LLMSERVE_WORKER_TOKEN)",
            )
        return self.port

    async def _stay_registered(self, registrar: Registrar) -> None:
        try:
            await registrar.run()
        except RegistrationRefused as error:
            log.error("registration_refused", scheduler=registrar.scheduler, reason=str(error))
            self.exit_code = 2
            os.kill(os.getpid(), signal.SIGTERM)  # stop like on SIGTERM, then exit with the code

    async def stop(self) -> None:
        if self._registration is not None:
            # Deregister first: the scheduler stops sending steps before the port closes.
            self._registration.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._registration
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(self.grace_seconds)
        self.servicer.shutdown()
        log.info("worker_stopped")


def rank_device(device: torch.device, rank: int, world_size: int, backend: str = "auto") -> torch.device:
    """One GPU per rank: with --device cuda:k, rank r of a group runs on cuda:(k + r). Over gloo
    ranks may share GPUs (rank r on cuda:((k + r) mod GPUs)); NCCL cannot run two ranks on one."""
    if device.type != "cuda" or world_size == 1:
        return device
    count = torch.cuda.device_count()
    index = (device.index or 0) + rank
    if backend == "gloo" and count > 0:
        return torch.device("cuda", index % count)
    if index >= count:
        raise ValueError(
            f"rank {rank} of {world_size} would run on cuda:{index}, but {count} GPUs are visible "
            f"(NCCL needs a GPU per rank; --dist-backend gloo lets ranks share one)"
        )
    return torch.device("cuda", index)
