"""SIGTERM to the scheduler process drains it: health goes NOT_SERVING, new requests are
refused with UNAVAILABLE, in-flight ones finish within --drain-timeout, then it exits 0."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.pb.llmserve.v1 import generation_pb2_grpc
from tests.conftest import REPO, WorkerProcess, collect, free_port, request, wait_serving


async def test_sigterm_drains_in_flight_requests_and_refuses_new_ones(
    tiny_model_dir: Path, tiny_worker: WorkerProcess
) -> None:
    port = free_port()
    proc = subprocess.Popen(
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
            tiny_worker.address,
            "--port",
            str(port),
            "--drain-timeout",
            "30",
        ],
        cwd=REPO,
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            await wait_serving(channel)
            # Slow enough to still be running when SIGTERM arrives: 400 tokens, a few ms each.
            in_flight = stub.Generate(request(ids=[7, 8, 9], max_tokens=400, ignore_eos=True))
            first = await in_flight.read()
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            status = (await health.Check(health_pb2.HealthCheckRequest(), timeout=2)).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub, request(ids=[1, 2], max_tokens=2))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in (err.value.details() or "")
            rest = []
            while (msg := await in_flight.read()) is not grpc.aio.EOF:
                rest.append(msg)
            assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == 400  # finished, not cut
        assert proc.wait(timeout=40) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
