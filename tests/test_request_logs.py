"""Every log line of a request carries the caller's x-request-id, an abort says why it came, and
one line says when the scheduler is ready.

A real scheduler process logging JSON at info level; its lines are read back from stderr.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from common.pb.llmserve.v1 import generation_pb2 as pb
from common.pb.llmserve.v1 import generation_pb2_grpc
from tests.conftest import REPO, WorkerProcess, free_port, wait_serving

LONG = pb.StoppingCriteria(max_tokens=500, ignore_eos=True)


@dataclass
class LoggingScheduler:
    port: int
    log: Path

    def lines(self, event: str, request_id: str) -> list[dict[str, object]]:
        found = []
        for line in self.log.read_text().splitlines():
            if line.startswith("{"):
                entry = json.loads(line)
                if entry.get("event") == event and entry.get("request_id") == request_id:
                    found.append(entry)
        return found

    async def logged(self, event: str, request_id: str) -> dict[str, object]:
        """The step loop writes it a step or two after the call ends."""
        for _ in range(500):
            if found := self.lines(event, request_id):
                return found[0]
            await asyncio.sleep(0.02)
        raise AssertionError(f"no {event} line for {request_id}")


@pytest.fixture(scope="module")
def scheduler(
    tiny_model_dir: Path, tiny_worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LoggingScheduler]:
    port = free_port()
    log = tmp_path_factory.mktemp("request-logs") / "scheduler.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "llmserve.cli",
                "--log-level",
                "info",
                "scheduler",
                "--model",
                str(tiny_model_dir),
                "--worker",
                tiny_worker.address,
                "--port",
                str(port),
            ],
            cwd=REPO,
            stdout=sink,
            stderr=sink,
            env={**os.environ, "LLMSERVE_LOG_JSON": "1"},
        )
    try:
        yield LoggingScheduler(port, log)
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture
async def stub(scheduler: LoggingScheduler) -> AsyncIterator[generation_pb2_grpc.GenerationStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{scheduler.port}") as channel:
        await wait_serving(channel)
        yield generation_pb2_grpc.GenerationStub(channel)


async def test_a_finished_request_logs_the_callers_id_on_each_line(
    scheduler: LoggingScheduler, stub: generation_pb2_grpc.GenerationStub
) -> None:
    request = pb.GenerateRequest(
        request_id="r-done", prompt_token_ids=[5, 6, 7], stopping=pb.StoppingCriteria(max_tokens=3)
    )
    [m async for m in stub.Generate(request, metadata=(("x-request-id", "trace-done"),))]
    finished = await scheduler.logged("request_finished", "r-done")
    assert finished["x_request_id"] == "trace-done"
    assert scheduler.lines("request_admitted", "r-done")[0]["x_request_id"] == "trace-done"


async def test_a_deadline_is_logged_as_the_abort_reason(
    scheduler: LoggingScheduler, stub: generation_pb2_grpc.GenerationStub
) -> None:
    request = pb.GenerateRequest(request_id="r-deadline", prompt_token_ids=[5, 6, 7], stopping=LONG)
    call = stub.Generate(request, timeout=0.5, metadata=(("x-request-id", "trace-deadline"),))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [m async for m in call]
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    aborted = await scheduler.logged("request_aborted", "r-deadline")
    assert aborted["reason"] == "deadline" and aborted["x_request_id"] == "trace-deadline"


async def test_a_cancel_is_logged_as_the_abort_reason(
    scheduler: LoggingScheduler, stub: generation_pb2_grpc.GenerationStub
) -> None:
    request = pb.GenerateRequest(request_id="r-cancel", prompt_token_ids=[5, 6, 7], stopping=LONG)
    call = stub.Generate(request, metadata=(("x-request-id", "trace-cancel"),))
    await call.read()
    call.cancel()
    aborted = await scheduler.logged("request_aborted", "r-cancel")
    assert aborted["reason"] == "cancelled" and aborted["x_request_id"] == "trace-cancel"


async def test_an_abort_call_is_logged_as_the_abort_reason(
    scheduler: LoggingScheduler, stub: generation_pb2_grpc.GenerationStub
) -> None:
    request = pb.GenerateRequest(request_id="r-abort", prompt_token_ids=[5, 6, 7], stopping=LONG)
    call = stub.Generate(request)
    await call.read()
    reply = await stub.Abort(pb.AbortRequest(request_ids=["r-abort"]))
    assert list(reply.aborted) == ["r-abort"]
    with pytest.raises(grpc.aio.AioRpcError):
        while await call.read() is not grpc.aio.EOF:
            pass
    aborted = await scheduler.logged("request_aborted", "r-abort")
    assert aborted["reason"] == "abort_call"


async def test_one_ready_line_once_a_worker_group_is_ready(
    scheduler: LoggingScheduler, stub: generation_pb2_grpc.GenerationStub
) -> None:
    """`scheduler_listening` comes when the port opens, seconds before anything can be
    answered; `ready` when the first worker group is, and only then."""
    events = [json.loads(line) for line in scheduler.log.read_text().splitlines() if line.startswith("{")]
    names = [e["event"] for e in events]
    assert names.count("ready") == 1, names
    ready = events[names.index("ready")]
    assert ready["grpc"] == f"127.0.0.1:{scheduler.port}" and ready["groups"] == 1
    assert names.index("scheduler_listening") < names.index("ready")
    assert names.index("worker_ready") < names.index("ready")
