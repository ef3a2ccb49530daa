"""Tensor-parallel worker groups through the real services: `llmserve worker --tp 2` starts
two gloo ranks, the scheduler drives them in lockstep, and greedy outputs equal the single
worker's. Killing a rank ends the whole group within the distributed timeout, leaving no
process behind."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from tests.conftest import REPO, WorkerProcess, collect, free_port, request, start_scheduler, stop_scheduler
from tests.engine_state import first_scheduler
from tests.test_smollm2_e2e import children_of

PROMPTS = [[200 + 13 * i + k for k in range(5 + 7 * i)] for i in range(4)]


_HANDED_OUT: set[int] = set()


def start_group(
    model_dir: Path, tp: int, dist_timeout: float = 5.0, extra: tuple[str, ...] = (), pp: int = 1
) -> tuple[subprocess.Popen[bytes], list[str]]:
    """`llmserve worker --tp tp --pp pp` on the CPU, and its ranks' addresses in rank order."""
    ranks = tp * pp
    port = free_port()
    # Ports this process handed out are not yet bound when a second group starts at once.
    while any(_busy(port + r) or port + r in _HANDED_OUT for r in range(ranks)):
        port = free_port()
    _HANDED_OUT.update(range(port, port + ranks))
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
        f"127.0.0.1:{port}",
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--num-gpu-blocks",
        "64",
        "--tp",
        str(tp),
        "--pp",
        str(pp),
        "--dist-timeout",
        str(dist_timeout),
        *extra,
    ]
    return subprocess.Popen(cmd, cwd=REPO), [f"127.0.0.1:{port + r}" for r in range(ranks)]


def _busy(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def alive(pids: list[int]) -> list[int]:
    return [
        p for p in pids if Path(f"/proc/{p}").exists() and "Z" not in Path(f"/proc/{p}/stat").read_text().split()[2]
    ]


async def test_a_tp2_group_streams_what_one_worker_streams(tiny_model_dir: Path, tiny_worker: WorkerProcess) -> None:
    single = await start_scheduler(tiny_model_dir, tiny_worker.address)
    try:
        await single.wait_ready()
        want = await asyncio.gather(
            *(collect(single.stub, request(ids=p, max_tokens=12, ignore_eos=True)) for p in PROMPTS)
        )
    finally:
        await stop_scheduler(single)
    launcher, addresses = start_group(tiny_model_dir, 2)
    s = await start_scheduler(tiny_model_dir, ",".join(addresses))
    try:
        await s.wait_ready()
        assert first_scheduler(s.engine).block_manager.num_blocks == 64
        got = await asyncio.gather(*(collect(s.stub, request(ids=p, max_tokens=12, ignore_eos=True)) for p in PROMPTS))
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        await s.wait_idle()
    finally:
        await stop_scheduler(s)
        launcher.terminate()
        assert launcher.wait(30) == 0


async def kill_a_rank_mid_stream(
    model_dir: Path, launcher: subprocess.Popen[bytes], addresses: list[str], victim: int, within: float
) -> None:
    """SIGKILL rank `victim` while a stream runs: the stream ends with an error within `within`
    seconds, the group's launcher exits non-zero and no rank outlives it."""
    s = await start_scheduler(model_dir, ",".join(addresses))
    try:
        await s.wait_ready()
        ranks = children_of(launcher.pid)
        assert len(ranks) == len(addresses)
        call = s.stub.Generate(request(ids=[5, 6, 7], max_tokens=400, ignore_eos=True))
        await call.read()
        port = addresses[victim].rsplit(":", 1)[1]
        pid = next(p for p in ranks if f"127.0.0.1:{port}" in Path(f"/proc/{p}/cmdline").read_text().replace("\0", " "))
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while await call.read() is not grpc.aio.EOF:
                pass
        assert err.value.code() in (grpc.StatusCode.ABORTED, grpc.StatusCode.UNAVAILABLE)
        assert time.monotonic() - start < within
        # The surviving ranks fail their next collective or transfer within the timeout.
        assert launcher.wait(30) != 0
        deadline = time.monotonic() + 10
        while alive(ranks) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert not alive(ranks), "a rank outlived its group"
    finally:
        await stop_scheduler(s)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


async def test_killing_one_rank_ends_the_group_and_leaves_no_process(tiny_model_dir: Path) -> None:
    launcher, addresses = start_group(tiny_model_dir, 2, dist_timeout=4.0)
    await kill_a_rank_mid_stream(tiny_model_dir, launcher, addresses, victim=1, within=10)


def test_a_group_size_the_model_cannot_split_is_refused_at_start(tiny_model_dir: Path) -> None:
    for command in ("worker", "up"):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "llmserve.cli",
                command,
                "--model",
                str(tiny_model_dir),
                "--device",
                "cpu",
                "--tp",
                "3",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 2, out.stderr
        assert "tp=3 cannot split 4 attention heads" in out.stderr + out.stdout
        assert "sizes that work: 1, 2, 4" in out.stderr + out.stdout
