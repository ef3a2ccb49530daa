"""`llmserve up` as an operator meets it: Ctrl-C with a request in flight, and a start that fails."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import openai
from openai.types import Completion

from common.pb.llmserve.v1 import generation_pb2_grpc
from tests.conftest import REPO, free_port, request, wait_serving
from tests.test_gateway import distinct_ports, wait_until


def _events(log: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


def _names(log: Path) -> list[str]:
    """Our own log lines' events, in order (smg's JSON lines have none)."""
    return [str(e["event"]) for e in _events(log) if "event" in e]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"


def _start_up(model: Path, port: int, log: Path, *flags: str) -> subprocess.Popen[bytes]:
    """`llmserve up` on `model` logging JSON to `log`, in its own session and process group as
    a shell starts a foreground job: killpg is then the terminal's Ctrl-C."""
    with log.open("a") as sink:  # appending: processes sharing it never write over each other
        return subprocess.Popen(
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
                str(port),
                "--drain-timeout",
                "60",
                *flags,
            ],
            cwd=REPO,
            stdout=sink,
            stderr=sink,
            start_new_session=True,
            env={**os.environ, "LLMSERVE_LOG_JSON": "1"},
        )


async def test_ctrl_c_drains_like_sigterm(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A terminal's Ctrl-C signals the whole foreground process group. The request in flight
    gets every token, `up` exits 0 without a traceback, and its worker ends with it."""
    port = free_port()
    log = tmp_path / "up.log"
    up = _start_up(tiny_model_dir, port, log, "--no-http")
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


def test_ctrl_c_with_the_gateway_drains_its_http_requests(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The same Ctrl-C with smg in front (`up`'s default). One sequence at a time, so that the
    queued requests outlast smg's 5 s of listening after SIGTERM and finish in its drain: the
    stream in flight and the four queued behind it all get every token, `up` exits 0 without
    a traceback, and neither smg nor the worker outlives it."""
    port, http_port, http_metrics_port = distinct_ports(3)
    log = tmp_path / "up.log"
    up = _start_up(
        tiny_model_dir,
        port,
        log,
        "--http-port",
        str(http_port),
        "--http-metrics-port",
        str(http_metrics_port),
        "--max-num-seqs",
        "1",
    )
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="x", max_retries=0, timeout=120)

    def long_story() -> Completion:
        return client.completions.create(
            model=tiny_model_dir.name, prompt="Tell me a long story", max_tokens=480, extra_body={"ignore_eos": True}
        )

    try:
        wait_until(lambda: "http_ready" in _names(log), 180, "the http_ready line", up)
        stream = iter(
            client.completions.create(
                model=tiny_model_dir.name,
                prompt="Tell me a long story",
                max_tokens=480,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
        )
        next(stream)
        with ThreadPoolExecutor(4) as pool:
            queued = [pool.submit(long_story) for _ in range(4)]
            wait_until(lambda: _names(log).count("request_admitted") == 5, 30, "four requests queued", up)
            os.killpg(up.pid, signal.SIGINT)
            rest = list(stream)
            answers = [q.result() for q in queued]
        assert rest[-1].usage is not None and rest[-1].usage.completion_tokens == 480
        assert [c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason] == ["length"]
        assert [(a.usage and a.usage.completion_tokens, a.choices[0].finish_reason) for a in answers] == [
            (480, "length")
        ] * 4
        assert up.wait(timeout=120) == 0
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
    assert "Traceback" not in log.read_text()
    events = _events(log)
    (worker,) = [int(e["pid"]) for e in events if e.get("event") == "worker_started"]  # type: ignore[call-overload]
    (smg,) = [int(e["pid"]) for e in events if e.get("event") == "gateway_started"]  # type: ignore[call-overload]
    wait_until(lambda: not _alive(worker) and not _alive(smg), 10, "the worker and smg gone")
    names = _names(log)
    assert not [n for n in names if n in ("worker_exited", "gateway_exited")], names
    # smg drains through the scheduler, so it stops first; the worker last.
    order = [names.index(n) for n in ("shutting_down", "gateway_stopped", "scheduler_stopped", "worker_stopped")]
    assert order == sorted(order), names[-12:]
