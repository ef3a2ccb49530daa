"""Several worker groups through the real services: real worker processes that register with
a scheduler on a real port, killed (SIGKILL) or stopped (SIGTERM) in the middle of generation.

Every disturbed stream must carry exactly the tokens of its undisturbed run (greedy,
float32), with nothing missing or repeated; with every worker gone requests end within
seconds; a worker that registers afterwards takes load.
"""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from common.pb.llmserve.v1 import generation_pb2 as pb
from tests.conftest import REPO, Scheduler, collect, free_port, request, stop_scheduler
from tests.test_registration import registry_scheduler, until

PROMPTS = [[random.Random(i).randrange(10, 40000) for _ in range(3 + 2 * i)] for i in range(16)]


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    address: str  # also its group name: a worker registers under its advertised address


def start_worker(model_dir: Path, scheduler_port: int, *extra: str) -> Worker:
    address = f"127.0.0.1:{free_port()}"
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
        address,
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--num-gpu-blocks",
        "128",
        "--scheduler",
        f"127.0.0.1:{scheduler_port}",
        *extra,
    ]
    return Worker(subprocess.Popen(cmd, cwd=REPO), address)


@asynccontextmanager
async def worker_groups(
    model_dir: Path, count: int = 2, worker_flags: tuple[str, ...] = (), **config: Any
) -> AsyncIterator[tuple[Scheduler, list[Worker]]]:
    """A registry scheduler (SchedulerConfig(**config)) and `count` worker processes registered
    with it, started with `worker_flags` too."""
    s = await registry_scheduler(model_dir, **config)
    workers = [start_worker(model_dir, s.port, *worker_flags) for _ in range(count)]
    try:
        await until(lambda: len(s.engine.replicas) == count, timeout=120)
        yield s, workers
    finally:
        await stop_scheduler(s)
        kill(workers)


@pytest.fixture
async def two_groups(tiny_model_dir: Path) -> AsyncIterator[tuple[Scheduler, list[Worker]]]:
    async with worker_groups(tiny_model_dir) as groups:
        yield groups


def kill(workers: list[Worker]) -> None:
    for w in workers:
        if w.proc.poll() is None:
            w.proc.kill()
        w.proc.wait(30)


def requests(max_tokens: int) -> list[pb.GenerateRequest]:
    return [request(ids=p, max_tokens=max_tokens, ignore_eos=True) for p in PROMPTS]


def replica(s: Scheduler, name: str):  # type: ignore[no-untyped-def]
    return next(r for r in s.engine.replicas if r.name == name)


async def mid_generation(s: Scheduler, w: Worker) -> None:
    """Until the worker's group runs requests that have streamed tokens (polled tightly)."""
    group = replica(s, w.address)
    deadline = time.monotonic() + 30
    while not (group.scheduler and any(g.seqs[0].num_output_tokens >= 2 for g in group.scheduler.queues.running)):
        assert time.monotonic() < deadline, "the group never ran a request"
        await asyncio.sleep(0.002)


def recovered(s: Scheduler, model_name: str = "tiny-llama") -> float:
    value = s.server.metrics.registry.get_sample_value(  # type: ignore[attr-defined]
        "llmserve:requests_recovered_total", {"model_name": model_name}
    )
    return float(value or 0.0)


async def test_a_killed_worker_costs_a_re_prefill_not_a_token_then_a_new_worker_takes_load(
    tiny_model_dir: Path, two_groups: tuple[Scheduler, list[Worker]]
) -> None:
    s, workers = two_groups
    reqs = requests(max_tokens=64)
    undisturbed = [g.token_ids for g in await asyncio.gather(*(collect(s.stub, r) for r in reqs))]
    assert all(len(t) == 64 for t in undisturbed)
    assert all(r.scheduler.next_step_id > 0 for r in s.engine.replicas)  # both groups served

    tasks = [asyncio.create_task(collect(s.stub, r)) for r in reqs]
    victim = workers[0]
    await mid_generation(s, victim)
    victim.proc.send_signal(signal.SIGKILL)
    disturbed = [g.token_ids for g in await asyncio.gather(*tasks)]
    assert disturbed == undisturbed
    assert recovered(s) >= 1
    assert [r.name for r in s.engine.replicas] == [workers[1].address]
    await s.wait_idle()

    # A new worker registers and is routed new requests without a restart.
    workers.append(start_worker(tiny_model_dir, s.port))
    await until(lambda: len(s.engine.replicas) == 2, timeout=120)
    again = [g.token_ids for g in await asyncio.gather(*(collect(s.stub, r) for r in reqs[:8]))]
    assert again == undisturbed[:8]
    assert replica(s, workers[2].address).scheduler.next_step_id > 0
    load = await s.stub.GetLoad(pb.GetLoadRequest())
    assert sorted(g.name for g in load.groups) == sorted([workers[1].address, workers[2].address])
    await s.wait_idle()


async def test_a_worker_stopped_with_sigterm_hands_its_requests_over_before_it_exits(
    two_groups: tuple[Scheduler, list[Worker]],
) -> None:
    s, workers = two_groups
    reqs = requests(max_tokens=48)
    undisturbed = [g.token_ids for g in await asyncio.gather(*(collect(s.stub, r) for r in reqs))]
    tasks = [asyncio.create_task(collect(s.stub, r)) for r in reqs]
    await mid_generation(s, workers[1])
    workers[1].proc.send_signal(signal.SIGTERM)
    disturbed = [g.token_ids for g in await asyncio.gather(*tasks)]
    assert disturbed == undisturbed
    assert recovered(s) >= 1
    await until(lambda: workers[1].proc.poll() is not None, timeout=30)
    assert workers[1].proc.returncode == 0
    await s.wait_idle()


async def test_a_frozen_worker_fails_its_health_checks_and_its_requests_move(tiny_model_dir: Path) -> None:
    """SIGSTOP: the process neither dies nor closes its streams; only health checks notice."""
    from common.config import SchedulerConfig, ServerConfig
    from common.pb.llmserve.v1 import generation_pb2_grpc
    from scheduler_svc.api.server import SchedulerServer

    server = SchedulerServer(str(tiny_model_dir), "", ServerConfig(port=0), SchedulerConfig(), health_interval=0.5)
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    s = Scheduler(server, channel, generation_pb2_grpc.GenerationStub(channel), port)
    workers = [start_worker(tiny_model_dir, port) for _ in range(2)]
    try:
        await until(lambda: len(s.engine.replicas) == 2, timeout=120)
        reqs = requests(max_tokens=64)
        undisturbed = [g.token_ids for g in await asyncio.gather(*(collect(s.stub, r) for r in reqs))]
        tasks = [asyncio.create_task(collect(s.stub, r)) for r in reqs]
        await mid_generation(s, workers[0])
        frozen = time.monotonic()
        workers[0].proc.send_signal(signal.SIGSTOP)
        disturbed = [g.token_ids for g in await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)]
        assert disturbed == undisturbed
        assert recovered(s) >= 1
        assert time.monotonic() - frozen < 20  # three 0.5 s checks (each may wait 1 s), not the step timeout
        await s.wait_idle()
    finally:
        await stop_scheduler(s)
        kill(workers)


async def test_with_every_worker_gone_requests_end_within_seconds_and_serving_resumes(
    tiny_model_dir: Path,
) -> None:
    s = await registry_scheduler(tiny_model_dir, max_num_seqs=2)  # others wait: they produce nothing
    workers = [start_worker(tiny_model_dir, s.port) for _ in range(2)]
    try:
        await until(lambda: len(s.engine.replicas) == 2, timeout=120)
        received: list[int] = [0] * 8
        codes: list[grpc.StatusCode | None] = [None] * 8

        async def follow(i: int, req: pb.GenerateRequest) -> None:
            try:
                async for message in s.stub.Generate(req):
                    received[i] += len(message.token_ids)
            except grpc.aio.AioRpcError as error:
                codes[i] = error.code()

        tasks = [asyncio.create_task(follow(i, r)) for i, r in enumerate(requests(max_tokens=400)[:8])]
        await mid_generation(s, workers[0])
        killed = time.monotonic()
        for w in workers:
            w.proc.send_signal(signal.SIGKILL)
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
        assert time.monotonic() - killed < 10
        for i in range(8):
            assert codes[i] == (grpc.StatusCode.ABORTED if received[i] else grpc.StatusCode.UNAVAILABLE), (
                i,
                received[i],
            )
        assert any(received) and not all(received)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(s.stub, request(ids=[5, 6], max_tokens=2))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert not s.engine._streams  # noqa: SLF001

        workers.append(start_worker(tiny_model_dir, s.port))
        await until(lambda: s.engine.ready, timeout=120)
        gen = await collect(s.stub, request(ids=[5, 6, 7], max_tokens=5, ignore_eos=True))
        assert len(gen.token_ids) == 5
        await s.wait_idle()
    finally:
        await stop_scheduler(s)
        kill(workers)


async def test_up_with_two_workers_serves_with_both_groups(tiny_model_dir: Path) -> None:
    from tests.test_smollm2_e2e import Up

    up = Up(tiny_model_dir, "--workers", "2", "--device", "cpu", "--num-gpu-blocks", "64")
    try:
        await asyncio.to_thread(up.wait_serving)
        async with grpc.aio.insecure_channel(up.address) as channel:
            from common.pb.llmserve.v1 import generation_pb2_grpc

            stub = generation_pb2_grpc.GenerationStub(channel)
            for _ in range(600):  # the second group may register a moment after the first
                if len((await stub.GetLoad(pb.GetLoadRequest())).groups) == 2:
                    break
                await asyncio.sleep(0.1)
            reqs = requests(max_tokens=200)[:8]
            tasks = [asyncio.create_task(collect(stub, r)) for r in reqs]
            busy: set[str] = set()
            while len(busy) < 2 and not all(t.done() for t in tasks):
                load = await stub.GetLoad(pb.GetLoadRequest())
                busy |= {g.name for g in load.groups if g.running}
                await asyncio.sleep(0.01)
            first = [g.token_ids for g in await asyncio.gather(*tasks)]
            assert len(busy) == 2, "one group did all the work"
            second = [g.token_ids for g in await asyncio.gather(*(collect(stub, r) for r in reqs))]
            assert first == second and all(len(t) == 200 for t in first)
        metrics = up.metrics()
        assert metrics.count("llmserve:group_gpu_blocks{") == 2
        assert metrics.count("llmserve:group_tokens_per_second{") == 2
    finally:
        up.proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(up.proc.wait, 60) == 0
