"""TLS, mutual TLS and reflection off, on real ports with certificates the test makes itself.

One worker process (TLS, client certificates required) and one in-process scheduler (TLS,
client certificates required, reflection off, mutual TLS to the worker) serve every test here.
The PKI: a CA that signs the server certificate (SAN 127.0.0.1 and localhost) and a client
certificate, and a second CA that signed nothing of ours.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.config import SchedulerConfig, ServerConfig, TlsClientConfig, TlsConfig
from common.grpc.tls import open_channel
from common.pb.llmserve.v1 import generation_pb2_grpc
from llmserve.cli.configs import client_tls_config, server_config, tls_config
from llmserve.cli.parser import build_parser
from scheduler_svc.api.server import SchedulerServer
from tests.conftest import REPO, WorkerProcess, collect, request, start_worker

EC_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True)
class Pki:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str


def _openssl(cwd: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _make_ca(d: Path, name: str) -> None:
    _openssl(
        d,
        "req",
        "-x509",
        *EC_KEY,
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.pem",
        "-days",
        "2",
        "-subj",
        f"/CN={name}",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    )


def _make_leaf(d: Path, name: str, ca: str, serial: int, extensions: str) -> None:
    _openssl(d, "req", "-new", *EC_KEY, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
    (d / f"{name}.ext").write_text(extensions)
    _openssl(
        d,
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        f"{ca}.pem",
        "-CAkey",
        f"{ca}.key",
        "-set_serial",
        str(serial),
        "-days",
        "2",
        "-extfile",
        f"{name}.ext",
        "-out",
        f"{name}.pem",
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    _make_ca(d, "ca")
    _make_ca(d, "other-ca")
    _make_leaf(d, "server", "ca", 1, "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    _make_leaf(d, "client", "ca", 2, "extendedKeyUsage=clientAuth\n")
    names = ("ca.pem", "server.pem", "server.key", "client.pem", "client.key", "other-ca.pem")
    return Pki(*(str(d / name) for name in names))


def _credentials(pki: Pki, *, client_cert: bool = True, ca: str | None = None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=Path(ca or pki.ca).read_bytes(),
        private_key=Path(pki.client_key).read_bytes() if client_cert else None,
        certificate_chain=Path(pki.client_cert).read_bytes() if client_cert else None,
    )


@pytest.fixture(scope="module")
def tls_worker(tiny_model_dir: Path, pki: Pki) -> Iterator[WorkerProcess]:
    worker = start_worker(
        tiny_model_dir,
        "--num-gpu-blocks",
        "64",
        "--tls-cert",
        pki.server_cert,
        "--tls-key",
        pki.server_key,
        "--tls-client-ca",
        pki.ca,
    )
    yield worker
    worker.stop()


async def _start_scheduler(
    model_dir: Path, worker_address: str, server: ServerConfig, worker_tls: TlsClientConfig
) -> SchedulerServer:
    s = SchedulerServer(
        str(model_dir), worker_address, server, SchedulerConfig(), step_timeout=60.0, worker_tls=worker_tls
    )
    await s.start()
    return s


@pytest.fixture(scope="module")
async def tls_scheduler(tiny_model_dir: Path, tls_worker: WorkerProcess, pki: Pki) -> AsyncIterator[SchedulerServer]:
    """TLS with client certificates required and reflection off; mutual TLS to the worker."""
    server = await _start_scheduler(
        tiny_model_dir,
        tls_worker.address,
        ServerConfig(
            host="127.0.0.1", port=0, tls=TlsConfig(pki.server_cert, pki.server_key, pki.ca), reflection=False
        ),
        TlsClientConfig(ca=pki.ca, cert=pki.client_cert, key=pki.client_key),
    )
    try:
        for _ in range(1200):
            if server.engine.ready:
                break
            await asyncio.sleep(0.1)
        assert server.engine.ready, "the scheduler never reached its TLS worker"
        yield server
    finally:
        await server.stop()


def _address(tls_scheduler: SchedulerServer) -> str:
    return f"127.0.0.1:{tls_scheduler.port}"


async def _health(channel: grpc.aio.Channel, service: str = "") -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
    return int(reply.status)


async def test_mutual_tls_client_streams_a_generation(tls_scheduler: SchedulerServer, pki: Pki) -> None:
    async with grpc.aio.secure_channel(_address(tls_scheduler), _credentials(pki)) as channel:
        gen = await collect(
            generation_pb2_grpc.GenerationStub(channel), request(ids=[10, 20, 30], max_tokens=5, ignore_eos=True)
        )
    assert len(gen.token_ids) == 5
    assert [m.completion_tokens for m in gen.messages] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("service", ["scheduler", "worker"])
async def test_plaintext_client_is_refused(
    service: str, tls_scheduler: SchedulerServer, tls_worker: WorkerProcess
) -> None:
    address = _address(tls_scheduler) if service == "scheduler" else tls_worker.address
    async with grpc.aio.insecure_channel(address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _health(channel)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("service", ["scheduler", "worker"])
async def test_client_without_a_certificate_is_refused(
    service: str, tls_scheduler: SchedulerServer, tls_worker: WorkerProcess, pki: Pki
) -> None:
    address = _address(tls_scheduler) if service == "scheduler" else tls_worker.address
    async with grpc.aio.secure_channel(address, _credentials(pki, client_cert=False)) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _health(channel)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_client_that_does_not_trust_the_server_ca_is_refused(tls_scheduler: SchedulerServer, pki: Pki) -> None:
    async with grpc.aio.secure_channel(_address(tls_scheduler), _credentials(pki, ca=pki.other_ca)) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _health(channel)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_server_name_override_is_what_the_certificate_is_checked_against(
    tls_scheduler: SchedulerServer, pki: Pki
) -> None:
    serving = health_pb2.HealthCheckResponse.SERVING
    good = TlsClientConfig(ca=pki.ca, cert=pki.client_cert, key=pki.client_key, server_name="localhost")
    async with open_channel(_address(tls_scheduler), good) as channel:
        assert await _health(channel) == serving
    bad = TlsClientConfig(ca=pki.ca, cert=pki.client_cert, key=pki.client_key, server_name="elsewhere.invalid")
    async with open_channel(_address(tls_scheduler), bad) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _health(channel)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def _list_services(channel: grpc.aio.Channel) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    replies = [r async for r in call]
    return sorted(s.name for r in replies for s in r.list_services_response.service)


async def test_reflection_off_leaves_health_on(
    tls_scheduler: SchedulerServer, tls_worker: WorkerProcess, pki: Pki
) -> None:
    async with grpc.aio.secure_channel(_address(tls_scheduler), _credentials(pki)) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _list_services(channel)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert await _health(channel) == health_pb2.HealthCheckResponse.SERVING
        assert await _health(channel, "llmserve.v1.Generation") == health_pb2.HealthCheckResponse.SERVING
    # The worker left reflection on: the same call lists its services over mutual TLS.
    async with grpc.aio.secure_channel(tls_worker.address, _credentials(pki)) as channel:
        assert await _list_services(channel) == [
            "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
            "llmserve.v1.Worker",
        ]


async def test_scheduler_that_does_not_trust_the_worker_ca_never_becomes_ready(
    tiny_model_dir: Path, tls_worker: WorkerProcess, tls_scheduler: SchedulerServer, pki: Pki
) -> None:
    # tls_scheduler proves the worker is up and accepts this client certificate.
    server = await _start_scheduler(
        tiny_model_dir,
        tls_worker.address,
        ServerConfig(host="127.0.0.1", port=0),
        TlsClientConfig(ca=pki.other_ca, cert=pki.client_cert, key=pki.client_key),
    )
    try:
        await asyncio.sleep(3.0)
        assert not server.engine.ready
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            assert await _health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        await server.stop()


async def test_a_worker_registers_over_mutual_tls(tiny_model_dir: Path, pki: Pki) -> None:
    """Register runs on the scheduler's public port, so it is as protected as Generate: a
    worker without the CA cannot register, one with the CA and a client certificate can."""
    server = await _start_scheduler(
        tiny_model_dir,
        "",
        ServerConfig(host="127.0.0.1", port=0, tls=TlsConfig(pki.server_cert, pki.server_key, pki.ca)),
        TlsClientConfig(ca=pki.ca, cert=pki.client_cert, key=pki.client_key),
    )
    common = ["--num-gpu-blocks", "64", "--scheduler", f"127.0.0.1:{server.port}"]
    untrusting = start_worker(
        tiny_model_dir,
        *common,
        "--scheduler-tls-ca",
        pki.other_ca,
        "--scheduler-tls-cert",
        pki.client_cert,
        "--scheduler-tls-key",
        pki.client_key,
    )
    trusting = None
    try:
        await asyncio.sleep(4.0)
        assert not server.engine.ready
        trusting = start_worker(
            tiny_model_dir,
            *common,
            "--scheduler-tls-ca",
            pki.ca,
            "--scheduler-tls-cert",
            pki.client_cert,
            "--scheduler-tls-key",
            pki.client_key,
            "--tls-cert",
            pki.server_cert,
            "--tls-key",
            pki.server_key,
            "--tls-client-ca",
            pki.ca,
        )
        for _ in range(1200):
            if server.engine.ready:
                break
            await asyncio.sleep(0.1)
        assert [r.worker.address for r in server.engine.replicas] == [trusting.address]
    finally:
        await server.stop()
        untrusting.stop()
        if trusting is not None:
            trusting.stop()


def test_tls_configs_refuse_missing_files_and_lone_halves(pki: Pki, tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(ValueError, match=f"TLS key '{missing}' is not a file"):
        TlsConfig(pki.server_cert, missing)
    with pytest.raises(ValueError, match="TLS client CA"):
        TlsConfig(pki.server_cert, pki.server_key, client_ca=missing)
    with pytest.raises(ValueError, match="needs its key"):
        TlsClientConfig(ca=pki.ca, cert=pki.client_cert)
    assert TlsClientConfig().ca is None  # TLS with the system roots


def test_cli_flags_build_the_configs(pki: Pki) -> None:
    a = build_parser().parse_args(
        [
            "scheduler",
            "--worker",
            "10.0.0.2:50052",
            "--no-reflection",
            "--tls-cert",
            pki.server_cert,
            "--tls-key",
            pki.server_key,
            "--tls-client-ca",
            pki.ca,
            "--worker-tls-ca",
            pki.ca,
            "--worker-tls-cert",
            pki.client_cert,
            "--worker-tls-key",
            pki.client_key,
            "--worker-tls-server-name",
            "worker.internal",
        ]
    )
    assert server_config(a) == ServerConfig(
        host="127.0.0.1", port=50051, tls=TlsConfig(pki.server_cert, pki.server_key, pki.ca), reflection=False
    )
    assert client_tls_config(a, "worker") == TlsClientConfig(pki.ca, pki.client_cert, pki.client_key, "worker.internal")
    plain = build_parser().parse_args(["scheduler", "--worker", "10.0.0.2:50052"])
    assert server_config(plain) == ServerConfig(host="127.0.0.1", port=50051)
    assert client_tls_config(plain, "worker") is None
    for command in (["worker"], ["up"]):
        a = build_parser().parse_args(
            [*command, "--no-reflection", "--tls-cert", pki.server_cert, "--tls-key", pki.server_key]
        )
        assert tls_config(a) == TlsConfig(pki.server_cert, pki.server_key) and a.no_reflection
    with pytest.raises(ValueError, match="--tls-client-ca needs --tls-cert and --tls-key"):
        tls_config(build_parser().parse_args(["worker", "--tls-client-ca", pki.ca]))
    with pytest.raises(ValueError, match="--worker-tls-cert and --worker-tls-key go together"):
        client_tls_config(
            build_parser().parse_args(["scheduler", "--worker", "w:1", "--worker-tls-key", pki.client_key]), "worker"
        )
    a = build_parser().parse_args(
        ["worker", "--scheduler", "s:1", "--scheduler-tls-ca", pki.ca, "--scheduler-tls-server-name", "s"]
    )
    assert client_tls_config(a, "scheduler") == TlsClientConfig(ca=pki.ca, server_name="s")
    assert client_tls_config(build_parser().parse_args(["worker"]), "scheduler") is None


def test_tls_cert_without_key_is_refused_before_anything_starts(pki: Pki) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmserve.cli",
            "scheduler",
            "--worker",
            "127.0.0.1:1",
            "--model",
            "/nonexistent",
            "--tls-cert",
            pki.server_cert,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert "--tls-cert and --tls-key go together" in proc.stderr
