"""Workers that register with the scheduler: a scheduler started with no worker waits
(NOT_SERVING, UNAVAILABLE), takes the first worker that registers without a restart, notices
its departure, takes the next one; a worker serving another model is refused and exits."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from common.config import SchedulerConfig, ServerConfig
from tests.conftest import REPO, Scheduler, collect, free_port, request, stop_scheduler


async def registry_scheduler(model_dir: Path) -> Scheduler:
    from common.pb.llmserve.v1 import generation_pb2_grpc
    from scheduler_svc.server import SchedulerServer

    server = SchedulerServer(str(model_dir), "", ServerConfig(port=0), SchedulerConfig(), step_timeout=60.0)
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return Scheduler(server, channel, generation_pb2_grpc.GenerationStub(channel), port)


def registering_worker(model_dir: Path, scheduler_port: int, *extra: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "common.cli", "--log-level", "warning", "worker", "--model", str(model_dir),
           "--listen", f"127.0.0.1:{free_port()}", "--dtype", "float32", "--device", "cpu", "--num-gpu-blocks", "64",
           "--scheduler", f"127.0.0.1:{scheduler_port}", *extra]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


async def until(condition: object, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.1)


async def test_a_late_worker_joins_leaves_and_is_replaced_without_a_restart(tiny_model_dir: Path) -> None:
    s = await registry_scheduler(tiny_model_dir)
    workers: list[subprocess.Popen[bytes]] = []
    try:
        await asyncio.sleep(0.5)
        assert not s.engine.ready
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(s.stub, request(ids=[1, 2], max_tokens=2))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        workers.append(registering_worker(tiny_model_dir, s.port))
        await until(lambda: s.engine.ready)
        first = await collect(s.stub, request(ids=[5, 6, 7], max_tokens=6, ignore_eos=True))
        assert len(first.token_ids) == 6
        # SIGTERM: the worker deregisters before it closes; the scheduler stops serving.
        workers[0].send_signal(signal.SIGTERM)
        assert workers[0].wait(30) == 0
        await until(lambda: not s.engine.ready, timeout=15)
        workers.append(registering_worker(tiny_model_dir, s.port))
        await until(lambda: s.engine.ready)
        again = await collect(s.stub, request(ids=[5, 6, 7], max_tokens=6, ignore_eos=True))
        assert again.token_ids == first.token_ids
        await s.wait_idle()
    finally:
        await stop_scheduler(s)
        for w in workers:
            if w.poll() is None:
                w.terminate()
                w.wait(30)


async def test_a_worker_serving_another_model_is_refused_and_exits(tiny_model_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "another-model"
    other.mkdir()
    for path in tiny_model_dir.iterdir():
        (other / path.name).symlink_to(path)
    s = await registry_scheduler(tiny_model_dir)
    try:
        worker = registering_worker(other, s.port)
        # Poll, never block: the scheduler under test runs on this event loop.
        await until(lambda: worker.poll() is not None, timeout=120)
        out = worker.stdout.read() if worker.stdout else b""
        assert worker.returncode == 2
        assert b"this scheduler serves model 'tiny-llama', the worker serves 'another-model'" in out
        assert not s.engine.ready
    finally:
        await stop_scheduler(s)


async def test_a_tp_group_registers_when_all_ranks_have(tiny_model_dir: Path) -> None:
    s = await registry_scheduler(tiny_model_dir)
    launcher = registering_worker(tiny_model_dir, s.port, "--tp", "2")
    try:
        await until(lambda: s.engine.ready, timeout=90)
        assert "," in s.engine.worker.address  # both ranks, as one group
        gen = await collect(s.stub, request(ids=[5, 6, 7], max_tokens=4, ignore_eos=True))
        assert len(gen.token_ids) == 4
        await s.wait_idle()
    finally:
        await stop_scheduler(s)
        launcher.terminate()
        launcher.wait(30)
