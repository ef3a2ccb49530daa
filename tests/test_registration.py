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


async def registry_scheduler(model_dir: Path, **config: int) -> Scheduler:
    from common.pb.llmserve.v1 import generation_pb2_grpc
    from scheduler_svc.api.server import SchedulerServer

    server = SchedulerServer(str(model_dir), "", ServerConfig(port=0), SchedulerConfig(**config), step_timeout=60.0)
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return Scheduler(server, channel, generation_pb2_grpc.GenerationStub(channel), port)


def registering_worker(model_dir: Path, scheduler_port: int, *extra: str) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "llmserve.cli",
        "--log-level",
        "warning",
        "worker",
        "--model",
        str(model_dir),
        "--listen",
        f"127.0.0.1:{free_port()}",
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--num-gpu-blocks",
        "64",
        "--scheduler",
        f"127.0.0.1:{scheduler_port}",
        *extra,
    ]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


async def until(condition: object, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.1)


async def refused(worker: subprocess.Popen[bytes]) -> bytes:
    """The output of a worker that must exit with status 2 (refused)."""
    # Poll, never block: the scheduler under test runs on this event loop.
    await until(lambda: worker.poll() is not None, timeout=120)
    assert worker.returncode == 2
    return worker.stdout.read() if worker.stdout else b""


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
        out = await refused(registering_worker(other, s.port))
        assert b"this scheduler serves model 'tiny-llama', the worker serves 'another-model'" in out
        assert not s.engine.ready
    finally:
        await stop_scheduler(s)


async def test_a_worker_with_another_block_size_is_refused_and_exits(tiny_model_dir: Path) -> None:
    s = await registry_scheduler(tiny_model_dir, block_size=16)
    try:
        out = await refused(registering_worker(tiny_model_dir, s.port, "--block-size", "32"))
        assert b"this scheduler uses KV blocks of 16 tokens, the worker 32; start it with --block-size 16" in out
        assert not s.engine.ready
    finally:
        await stop_scheduler(s)


def test_the_registry_refuses_a_block_size_unlike_the_serving_groups() -> None:
    from scheduler_svc.workers.worker_registry import Registration, WorkerRegistry

    joined: list[str] = []
    size = {"now": 0}
    registry = WorkerRegistry("m", lambda name, _: joined.append(name), lambda _: None, block_size=lambda: size["now"])
    assert registry.join(Registration("a:1", "a", 0, 1, "m", block_size=32)) is None  # nothing serves yet: any size
    size["now"] = 32  # the engine adopted group a's
    refusal = registry.join(Registration("b:1", "b", 0, 1, "m", block_size=16))
    assert refusal is not None and "KV blocks of 32 tokens, the worker 16" in refusal
    assert registry.join(Registration("c:1", "c", 0, 1, "m", block_size=32)) is None
    assert joined == ["a", "c"]


async def test_a_tp_group_registers_when_all_ranks_have(tiny_model_dir: Path) -> None:
    s = await registry_scheduler(tiny_model_dir)
    launcher = registering_worker(tiny_model_dir, s.port, "--tp", "2")
    try:
        await until(lambda: s.engine.ready, timeout=90)
        assert "," in s.engine.replicas[0].worker.address  # both ranks, as one group
        gen = await collect(s.stub, request(ids=[5, 6, 7], max_tokens=4, ignore_eos=True))
        assert len(gen.token_ids) == 4
        await s.wait_idle()
    finally:
        await stop_scheduler(s)
        launcher.terminate()
        launcher.wait(30)
