"""`llmserve up` as an operator meets it: Ctrl-C with a request in flight, and a start that fails."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import grpc

from common.pb.llmserve.v1 import generation_pb2_grpc
from tests.conftest import REPO, free_port, request, wait_serving


def _events(log: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"


async def test_ctrl_c_drains_like_sigterm(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A terminal's Ctrl-C signals the whole foreground process group. The request in flight
    gets every token, `up` exits 0 without a traceback, and its worker ends with it."""
    port = free_port()
    log = tmp_path / "up.log"
    with log.open("w") as sink:
        # Its own session and group, as a shell gives a foreground job: killpg is the Ctrl-C.
        up = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "llmserve.cli",
                "--log-level",
                "info",
                "up",
                "--model",
                str(tiny_model_dir),
                "--dtype",
                "float32",
                "--device",
                "cpu",
                "--port",
                str(port),
                "--no-http",
                "--drain-timeout",
                "60",
            ],
            cwd=REPO,
            stdout=sink,
            stderr=sink,
            start_new_session=True,
            env={**os.environ, "LLMSERVE_LOG_JSON": "1"},
        )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await wait_serving(channel, timeout=120)
            call = generation_pb2_grpc.GenerationStub(channel).Generate(
                request(ids=[7, 8, 9], max_tokens=300, ignore_eos=True)
            )
            received = len((await call.read()).token_ids)
            os.killpg(up.pid, signal.SIGINT)
            while (message := await call.read()) is not grpc.aio.EOF:
                received += len(message.token_ids)
        assert received == 300
        assert up.wait(timeout=90) == 0
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
    events = _events(log)
    assert "Traceback" not in log.read_text()
    workers = [e["pid"] for e in events if e["event"] == "worker_started"]
    assert len(workers) == 1 and not _alive(int(workers[0]))  # type: ignore[call-overload]
    assert not [e for e in events if e["event"] == "worker_exited"], "the worker died under up"
    # The worker's own server stops after the scheduler has drained, when up stops it: had it
    # taken the Ctrl-C itself, it would have begun stopping at once, under the running stream.
    names = [(e["event"], "pid" in e) for e in events]
    assert names.index(("worker_stopped", False)) > names.index(("scheduler_stopped", False)), names


def test_a_start_that_fails_leaves_no_temp_dir_and_no_worker(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The worker has started when the scheduler refuses the model (no tokenizer.json): the
    worker is stopped, the socket directory removed, and the reason is one line, exit 2."""
    model = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_model_dir, model)
    (model / "tokenizer.json").unlink()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmserve.cli",
            "--log-level",
            "info",
            "up",
            "--model",
            str(model),
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--port",
            "0",
            "--no-http",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TMPDIR": str(tmp), "LLMSERVE_LOG_JSON": "1"},
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    events = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    assert [e["reason"] for e in events if e["event"] == "invalid_configuration"] == [
        f"{model} has no tokenizer.json (a fast tokenizer is required)"
    ]
    assert [e["event"] for e in events if e["event"].startswith("worker_")] == ["worker_started", "worker_stopped"]
    assert list(tmp.iterdir()) == []
