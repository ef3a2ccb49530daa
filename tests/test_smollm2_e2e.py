"""`llmserve up` with the real SmolLM2 model, exactly as a user runs it.

Greedy outputs in float32 must equal transformers' greedy `generate` token for token, for
varied prompts sent concurrently; grpcurl must see the services through reflection; after
SIGTERM no process may be left.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.pb.llmserve.v1 import generation_pb2 as pb
from common.pb.llmserve.v1 import generation_pb2_grpc
from tests.conftest import REPO, collect, free_port, request

pytestmark = pytest.mark.slow

MAX_NEW = 40
CHATS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 10.",
]
RAW = [
    "The history of the Roman Empire",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "Ünïcödé and émojis 🎉 are tricky:",
]
GRPCURL = str(Path(sys.executable).parent / "grpcurl")


def children_of(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


class Up:
    def __init__(self, model_dir: Path, *extra: str) -> None:
        self.port, self.metrics_port = free_port(), free_port()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "llmserve.cli",
                "--log-level",
                "warning",
                "up",
                "--model",
                str(model_dir),
                "--dtype",
                "float32",
                "--port",
                str(self.port),
                "--metrics-port",
                str(self.metrics_port),
                "--no-http",
                *extra,
            ],  # gRPC only (tests/test_gateway.py has the HTTP side); two run at once here
            cwd=REPO,
        )
        self.address = f"127.0.0.1:{self.port}"

    def wait_serving(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                assert self.proc.poll() is None, "llmserve up exited early"
                try:
                    if (
                        stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
                        == health_pb2.HealthCheckResponse.SERVING
                    ):
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.5)
        raise TimeoutError("llmserve up never became SERVING")

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()


@pytest.fixture(scope="module")
def up(smollm2_dir: Path) -> Iterator[Up]:
    server = Up(smollm2_dir)
    try:
        server.wait_serving()
        yield server
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()


@pytest.fixture(scope="module")
def prompts(smollm2_dir: Path) -> list[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    chats = [
        tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True)
        for c in CHATS
    ]
    return chats + RAW


def reference(model_dir: Path, prompts: list[str], **generate: object) -> list[tuple[int, list[int]]]:
    """(prompt length, generated ids) of transformers' `generate` in float32, per prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = tok(prompt, return_tensors="pt").input_ids
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, **generate)
            out.append((ids.shape[1], gen[0, ids.shape[1] :].tolist()))
    return out


def test_greedy_equals_transformers_for_concurrent_prompts(up: Up, smollm2_dir: Path, prompts: list[str]) -> None:
    async def run() -> list:
        async with grpc.aio.insecure_channel(up.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            return await asyncio.gather(*(collect(stub, request(p, max_tokens=MAX_NEW)) for p in prompts))

    ours = asyncio.run(run())
    want = reference(smollm2_dir, prompts, max_new_tokens=MAX_NEW)
    for prompt, gen, (prompt_len, ref_tokens) in zip(prompts, ours, want):
        assert gen.final.prompt_tokens == prompt_len, prompt
        assert gen.token_ids == ref_tokens, f"differs for {prompt!r}"
    assert any(g.final.finish_reason == pb.FINISH_REASON_STOP for g in ours)  # chat answers end on eos
    assert all(g.text for g in ours)


BEAM_NEW = 16


def test_beam_search_equals_transformers_beam_search(up: Up, smollm2_dir: Path, prompts: list[str]) -> None:
    chosen = [prompts[0], prompts[3], prompts[4], prompts[5]]

    async def run() -> list:
        async with grpc.aio.insecure_channel(up.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            return await asyncio.gather(*(collect(stub, request(p, max_tokens=BEAM_NEW, beam_width=4)) for p in chosen))

    ours = asyncio.run(run())
    want = reference(
        smollm2_dir, chosen, max_new_tokens=BEAM_NEW, num_beams=4, length_penalty=1.0, early_stopping=False
    )
    for prompt, gen, (_, ref) in zip(chosen, ours, want):
        assert len(gen.messages) == 1 and gen.final.index == 0
        assert gen.token_ids == ref, f"best beam differs for {prompt!r}"


def test_tp3_group_gives_the_greedy_outputs_of_one_worker(smollm2_dir: Path, prompts: list[str]) -> None:
    """SmolLM2's 9 query and 3 KV heads split over 3 gloo ranks: one KV head each."""
    chosen = prompts[:2] + prompts[4:6]
    server = Up(smollm2_dir, "--tp", "3")
    try:
        server.wait_serving()

        async def run() -> list:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                return await asyncio.gather(*(collect(stub, request(p, max_tokens=24)) for p in chosen))

        ours = asyncio.run(run())
        want = reference(smollm2_dir, chosen, max_new_tokens=24)
        assert [g.token_ids for g in ours] == [w for _, w in want]
        ranks = children_of(children_of(server.proc.pid)[0])
        assert len(ranks) == 3
    finally:
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0


def test_grpcurl_lists_services_and_streams_a_generation(up: Up) -> None:
    listed = subprocess.run(
        [GRPCURL, "-plaintext", up.address, "list"], capture_output=True, text=True, timeout=30, check=True
    )
    # examples/grpcurl.md shows this listing: it must stay what the server says.
    example = (REPO / "examples" / "grpcurl.md").read_text()
    shown = example.split("$ $G -plaintext $ADDR list\n", 1)[1].split("```", 1)[0].split()
    assert listed.stdout.split() == shown
    body = json.dumps({"prompt": "The capital of France is", "stopping": {"maxTokens": 6, "ignoreEos": True}})
    call = subprocess.run(
        [GRPCURL, "-plaintext", "-d", body, up.address, "llmserve.v1.Generation/Generate"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    messages = [json.loads(chunk) for chunk in call.stdout.replace("}\n{", "}\x00{").split("\x00") if chunk.strip()]
    assert sum(len(m.get("token_ids", m.get("tokenIds", []))) for m in messages) == 6
    assert messages[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
    assert "Paris" in "".join(m.get("text", "") for m in messages)


def test_generate_command_streams_to_the_terminal(up: Up) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmserve.cli",
            "generate",
            "The capital of France is",
            "--address",
            up.address,
            "--max-tokens",
            "5",
            "--ignore-eos",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=REPO,
    )
    assert "Paris" in out.stdout
    assert "5 generated, finish: length" in out.stderr


def test_metrics_return_to_idle_after_the_requests(up: Up) -> None:
    async def one() -> None:
        async with grpc.aio.insecure_channel(up.address) as channel:
            await collect(generation_pb2_grpc.GenerationStub(channel), request("Hello", max_tokens=3))

    asyncio.run(one())
    text = up.metrics()
    label = 'model_name="SmolLM2-135M-Instruct"'
    assert f"llmserve:kv_cache_usage_perc{{{label}}} 0.0" in text
    assert f"llmserve:num_requests_running{{{label}}} 0.0" in text
    generated = [line for line in text.splitlines() if line.startswith(f"llmserve:generation_tokens_total{{{label}}}")]
    assert generated and float(generated[0].split()[-1]) > 0
    assert "llmserve:step_plan_bytes_bucket" in text and "llmserve:step_roundtrip_seconds_count" in text


def test_sigterm_shuts_down_cleanly_leaving_no_process(up: Up) -> None:
    workers = children_of(up.proc.pid)
    assert workers, "llmserve up should have a worker child"
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [
        pid
        for pid in workers
        if Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
    ]
    assert not alive, f"processes left behind: {alive}"
