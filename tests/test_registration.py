"""Workers that register with the scheduler: a scheduler started with no worker waits
(NOT_SERVING, UNAVAILABLE), takes the first worker that registers without a restart, notices
its departure, takes the next one; a worker serving another model is refused and exits."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

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


async def test_the_registry_refuses_a_block_size_unlike_the_serving_groups() -> None:
    from scheduler_svc.workers.worker_registry import Member, Registration, WorkerRegistry

    joined: list[str] = []
    size = {"now": 0}
    registry = WorkerRegistry(
        "m", lambda name, _, __: joined.append(name), lambda _: None, block_size=lambda: size["now"]
    )
    # Nothing serves yet: any size.
    assert isinstance(registry.join(Registration("a:1", "a", 0, 1, "m", block_size=32)), Member)
    size["now"] = 32  # the engine adopted group a's
    refusal = registry.join(Registration("b:1", "b", 0, 1, "m", block_size=16))
    assert isinstance(refusal, str) and "KV blocks of 32 tokens, the worker 16" in refusal
    assert isinstance(registry.join(Registration("c:1", "c", 0, 1, "m", block_size=32)), Member)
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


def _registry(**config: Any) -> tuple[Any, list[tuple[str, list[str], Any]], list[str]]:
    """A registry for model "m" and what it told the engine: completed groups, departures."""
    from common.config import RegistryConfig
    from scheduler_svc.workers.worker_registry import WorkerRegistry

    complete: list[tuple[str, list[str], Any]] = []
    departed: list[str] = []
    registry = WorkerRegistry(
        "m", lambda *group: complete.append(group), departed.append, config=RegistryConfig(**config)
    )
    return registry, complete, departed


@pytest.mark.parametrize(
    ("config", "fields", "error", "message"),
    [
        ({"enabled": False}, {}, "FailedPrecondition", "takes no registrations (--no-registration)"),
        ({"allow": ("10.0.0.9",)}, {}, "PermissionDenied", "'10.0.0.1:5' is not on this scheduler's worker allow-list"),
        ({}, {"address": "h:" + "1" * 600}, "InvalidArgument", "address: 602 characters, at most 512"),
        ({}, {"group": "g" * 300}, "InvalidArgument", "group: 300 characters, at most 256"),
        ({}, {"world_size": 65}, "InvalidArgument", "world_size: 65, want between 1 and 64"),
        ({}, {"rank": 2, "world_size": 2}, "InvalidArgument", "rank 2 is not in a group of 2"),
        ({}, {"block_size": 7}, "InvalidArgument", "block_size: 7, want one of 8, 16, 32, 64, 128"),
        ({}, {"address": ""}, "InvalidArgument", "no address"),
        # A second address to dial, smuggled past the allow-list after a comma.
        ({"allow": ("10.0.0.1",)}, {"address": "10.0.0.1:5,evil.example:5555"}, "InvalidArgument", "without commas"),
        ({}, {"address": "10.0.0.1:5 evil:1"}, "InvalidArgument", "without commas, spaces"),
    ],
)
async def test_the_registration_policy_refuses_before_anything_is_dialed(
    config: dict[str, Any], fields: dict[str, Any], error: str, message: str
) -> None:
    from common import errors
    from scheduler_svc.workers.worker_registry import Registration

    registry, complete, _ = _registry(**config)
    r = Registration(**{"address": "10.0.0.1:5", "group": "g", "rank": 0, "world_size": 1, "model_name": "m", **fields})
    with pytest.raises(getattr(errors, error), match=re.escape(message)):
        registry.join(r)
    assert complete == [] and registry.num_pending == 0


@pytest.mark.parametrize(
    ("address", "allow", "expected"),
    [
        ("10.0.0.1:5", ("10.0.0.1",), True),
        ("10.0.0.1:5", ("10.0.0.1:5",), True),
        ("10.0.0.1:5", ("10.0.0.1:6",), False),
        ("10.0.0.10:5", ("10.0.0.1",), False),
        ("Worker-0.svc:5", ("worker-0.svc",), True),
        ("[::1]:5", ("::1",), True),
        ("[::1]:5", ("[::1]:5",), True),
        ("[::1]:5", ("[::1]:6",), False),
        ("unix:///run/w.sock", ("unix:///run/w.sock",), True),
        ("unix:///run/w.sock.1", ("unix:///run/w.sock",), False),
        ("dns:///10.0.0.1:5", ("10.0.0.1",), False),
    ],
)
def test_allow_list_entries_match_host_port_host_or_socket(
    address: str, allow: tuple[str, ...], expected: bool
) -> None:
    from scheduler_svc.workers.worker_registry import allowed

    assert allowed(address, allow) is expected


async def test_a_group_that_does_not_complete_in_time_is_dropped() -> None:
    from scheduler_svc.workers.worker_registry import Member, Registration

    registry, complete, departed = _registry(join_timeout=0.05)
    first = registry.join(Registration("h:1", "g", 0, 2, "m"))
    assert isinstance(first, Member) and registry.num_pending == 1
    await asyncio.wait_for(first.ended.wait(), 10)
    assert first.ending is not None and first.ending.retry
    assert "group 'g' did not complete within 0.05s (1 of 2 ranks registered; never joined: rank 1)" in (
        first.ending.message
    )
    assert registry.num_pending == 0
    registry.leave(first)  # its call ends afterwards: nothing more happens
    # The name is free again, for a group of another size too.
    again = registry.join(Registration("h:1", "g", 0, 3, "m"))
    assert isinstance(again, Member) and not again.ended.is_set()
    assert complete == [] and departed == []


async def test_pending_ranks_are_bounded_but_a_completing_rank_is_taken() -> None:
    from common.errors import ResourceExhausted
    from scheduler_svc.workers.worker_registry import Member, Registration

    registry, complete, _ = _registry(max_pending=2)
    assert isinstance(registry.join(Registration("h:1", "a", 0, 2, "m")), Member)
    assert isinstance(registry.join(Registration("h:2", "b", 0, 2, "m")), Member)
    with pytest.raises(ResourceExhausted, match="2 ranks already wait"):
        registry.join(Registration("h:3", "c", 0, 2, "m"))
    assert isinstance(registry.join(Registration("h:4", "a", 1, 2, "m")), Member)  # completes a
    assert [name for name, _, _ in complete] == ["a"] and registry.num_pending == 1


async def test_a_complete_group_keeps_its_name_and_size() -> None:
    from scheduler_svc.workers.worker_registry import Member, Registration

    registry, complete, departed = _registry()
    members = [registry.join(Registration(f"h:{r}", "a", r, 2, "m")) for r in range(2)]
    assert all(isinstance(m, Member) for m in members)
    assert complete[0][:2] == ("a", ["h:0", "h:1"])
    taken = registry.join(Registration("evil:1", "a", 0, 2, "m"))
    assert isinstance(taken, str) and "rank 0 of group 'a' is already registered (at h:0)" in taken
    resized = registry.join(Registration("evil:1", "a", 0, 3, "m"))
    assert isinstance(resized, str) and "group 'a' has 2 ranks, this rank says 3" in resized
    registry.leave(members[1])  # type: ignore[arg-type]
    assert departed == ["a"]


async def test_a_group_the_engine_refuses_has_its_registrations_ended() -> None:
    from scheduler_svc.workers.worker_registry import Member, Registration

    registry, complete, departed = _registry()
    members = [registry.join(Registration(f"h:{r}", "a", r, 2, "m")) for r in range(2)]
    _, _, refuse = complete[0]
    refuse("worker reports 4294967295 KV blocks")
    for member in members:
        assert isinstance(member, Member) and member.ended.is_set() and member.ending is not None
        assert not member.ending.retry
        assert member.ending.message == "the scheduler refused group 'a': worker reports 4294967295 KV blocks"
        registry.leave(member)
    assert departed == []  # refused, never served: nothing to detach
    assert isinstance(registry.join(Registration("h:0", "a", 0, 1, "m")), Member)  # the name is free
