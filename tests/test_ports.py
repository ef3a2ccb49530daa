"""A port another process holds is refused with one line and exit code 2; nobody shares a port."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from common.grpc.ports import EXCLUSIVE, PortUnavailable, bind, check_free, serve_http
from tests.conftest import REPO


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port some other program listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def test_a_held_port_is_refused_by_name(held_port: int) -> None:
    with pytest.raises(PortUnavailable, match=f"^--port 127.0.0.1:{held_port}: in use by another process$"):
        check_free(f"127.0.0.1:{held_port}", "--port")


def test_free_ports_port_zero_and_unix_sockets_pass(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free = int(sock.getsockname()[1])
    for address in (f"127.0.0.1:{free}", "127.0.0.1:0", f"unix://{tmp_path}/s.sock"):
        check_free(address, "--port")


def test_an_address_this_machine_lacks_is_refused() -> None:
    with pytest.raises(PortUnavailable, match="^--listen 203.0.113.9:50052: "):
        check_free("203.0.113.9:50052", "--listen")


def test_two_of_our_grpc_servers_never_share_a_port() -> None:
    """gRPC's default SO_REUSEPORT would let the second bind succeed and split the traffic."""

    async def main() -> None:
        first = grpc.aio.server(options=[EXCLUSIVE])
        port = bind(first, "127.0.0.1:0", None, "--port")
        await first.start()
        try:
            second = grpc.aio.server(options=[EXCLUSIVE])
            with pytest.raises(PortUnavailable, match="in use by another process"):
                bind(second, f"127.0.0.1:{port}", None, "--port")
            # The probe alone is not what refuses: gRPC itself is told not to share.
            shared = grpc.aio.server()
            with pytest.raises(RuntimeError, match="Failed to bind"):
                shared.add_insecure_port(f"127.0.0.1:{port}")
        finally:
            await first.stop(0)

    asyncio.run(main())


def test_a_held_metrics_port_is_refused_by_name(held_port: int) -> None:
    from prometheus_client import CollectorRegistry, start_http_server

    with pytest.raises(PortUnavailable, match=f"^--metrics-port {held_port} on 127.0.0.1: in use by another process$"):
        serve_http(
            lambda port, host: start_http_server(port, addr=host, registry=CollectorRegistry()),
            held_port,
            "127.0.0.1",
            "--metrics-port",
        )


@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
def test_a_scheduler_on_a_held_port_exits_2_with_one_line(tiny_model_dir: Path, held_port: int, flag: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free = str(sock.getsockname()[1])
    ports = {"--port": free, "--metrics-port": free, flag: str(held_port)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmserve.cli",
            "--log-level",
            "warning",
            "scheduler",
            "--model",
            str(tiny_model_dir),
            "--worker",
            "127.0.0.1:1",
            "--port",
            ports["--port"],
            "--metrics-port",
            ports["--metrics-port"],
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "LLMSERVE_LOG_JSON": "0"},
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    output = (proc.stdout + proc.stderr).strip().splitlines()
    assert "Traceback" not in proc.stderr
    refusals = [line for line in output if "in use by another process" in line]
    assert len(refusals) == 1 and flag in refusals[0], output


def test_a_worker_on_a_held_port_exits_2_before_loading(tiny_model_dir: Path, held_port: int) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmserve.cli",
            "--log-level",
            "info",
            "worker",
            "--model",
            str(tiny_model_dir),
            "--listen",
            f"127.0.0.1:{held_port}",
            "--device",
            "cpu",
            "--dtype",
            "float32",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "LLMSERVE_LOG_JSON": "0"},
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "kv_cache_allocated" not in proc.stdout + proc.stderr
    assert f"--listen 127.0.0.1:{held_port}: in use by another process" in proc.stdout + proc.stderr
