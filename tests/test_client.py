"""llmserve.client against a real in-process scheduler and tiny worker.

The blocking client runs in a thread (`asyncio.to_thread`): the scheduler it talks to is served
by this test's own event loop.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from common.pb.llmserve.v1 import generation_pb2 as pb
from llmserve.client import (
    AsyncLlmserveClient,
    GenerateParams,
    LlmserveClient,
    generate_request,
)
from tests.conftest import (
    Scheduler,
    WorkerProcess,
    collect,
    free_port,
    request,
    start_scheduler,
    stop_scheduler,
)
from tests.engine_state import first_scheduler


def address(s: Scheduler) -> str:
    return f"127.0.0.1:{s.port}"


def test_generate_request_keeps_proto_defaults_and_sets_only_what_is_given() -> None:
    req = generate_request(
        messages=[{"role": "user", "content": "hi"}, pb.ChatMessage(role="assistant", content="yo")],
        max_tokens=5,
        stop=["\n"],
        request_id="r1",
    )
    assert [(m.role, m.content) for m in req.messages] == [("user", "hi"), ("assistant", "yo")]
    assert req.stopping.max_tokens == 5 and list(req.stopping.stop) == ["\n"] and req.request_id == "r1"
    assert not req.sampling.HasField("seed")
    assert req.sampling.temperature == 0 and req.sampling.n == 0 and req.prompt == ""
    assert generate_request("x", seed=0).sampling.HasField("seed")


async def test_sync_client_streams_and_generate_text_joins_the_stream(tiny_scheduler: Scheduler) -> None:
    expected = await collect(tiny_scheduler.stub, request(ids=[10, 20, 30, 40], max_tokens=7, ignore_eos=True))

    def run() -> tuple[list[pb.GenerateResponse], str]:
        with LlmserveClient(address(tiny_scheduler)) as client:
            params: GenerateParams = {"prompt_token_ids": [10, 20, 30, 40], "max_tokens": 7, "ignore_eos": True}
            return list(client.generate(**params)), client.generate_text(**params)

    messages, text = await asyncio.to_thread(run)
    assert [t for m in messages for t in m.token_ids] == expected.token_ids
    assert text == "".join(m.text for m in messages) == expected.text
    assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert messages[-1].completion_tokens == 7


async def test_async_client_streams_and_generate_text_joins_the_stream(tiny_scheduler: Scheduler) -> None:
    prompt = "Hello there, how are you?"
    async with AsyncLlmserveClient(address(tiny_scheduler)) as client:
        messages = [m async for m in client.generate(prompt, max_tokens=6, ignore_eos=True, temperature=0.8, seed=7)]
        text = await client.generate_text(prompt, max_tokens=6, ignore_eos=True, temperature=0.8, seed=7)
    assert text == "".join(m.text for m in messages)
    assert messages[-1].prompt_tokens == len(tiny_scheduler.engine.tokenizer.encode(prompt))
    assert messages[-1].completion_tokens == 6


async def test_generate_text_keeps_output_0_only(tiny_scheduler: Scheduler) -> None:
    async with AsyncLlmserveClient(address(tiny_scheduler)) as client:
        params: GenerateParams = {
            "prompt_token_ids": [5, 6, 7],
            "max_tokens": 5,
            "ignore_eos": True,
            "temperature": 1.0,
            "seed": 3,
            "n": 2,
        }
        messages = [m async for m in client.generate(**params)]
        text = await client.generate_text(**params)
    assert {m.index for m in messages} == {0, 1}
    assert text == "".join(m.text for m in messages if m.index == 0)


async def test_errors_are_rpc_errors_with_the_server_status(tiny_scheduler: Scheduler) -> None:
    def sync_empty_prompt() -> grpc.StatusCode:
        with LlmserveClient(address(tiny_scheduler)) as client, pytest.raises(grpc.RpcError) as caught:
            client.generate_text("", max_tokens=4)
        return caught.value.code()

    assert await asyncio.to_thread(sync_empty_prompt) == grpc.StatusCode.INVALID_ARGUMENT
    async with AsyncLlmserveClient(address(tiny_scheduler)) as client:
        with pytest.raises(grpc.RpcError) as caught:
            await client.generate_text("hi", top_p=1.5)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.top_p" in caught.value.details()
        with pytest.raises(grpc.RpcError) as caught:
            await client.generate_text(prompt_token_ids=[1] * 400, ignore_eos=True, timeout=0.001)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_unreachable_or_wrong_credentials_is_unavailable(tiny_scheduler: Scheduler) -> None:
    async with AsyncLlmserveClient(f"127.0.0.1:{free_port()}") as client:
        with pytest.raises(grpc.RpcError) as caught:
            await client.generate_text("hi", max_tokens=2)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    # TLS against the plaintext test server: the handshake fails.
    async with AsyncLlmserveClient(address(tiny_scheduler), secure=grpc.ssl_channel_credentials()) as client:
        with pytest.raises(grpc.RpcError) as caught:
            await client.generate_text("hi", max_tokens=2, timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


async def assert_request_gone_within_steps(s: Scheduler, step_at_close: int) -> None:
    """The request was aborted: the engine ran out of work within a step or two of the close
    (it had hundreds of tokens left to generate)."""
    sched = first_scheduler(s.engine)
    deadline = asyncio.get_running_loop().time() + 10
    while sched.has_work and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.001)
    assert not sched.has_work
    assert sched._next_step_id - step_at_close <= 3


async def test_closing_a_stream_aborts_the_request(tiny_scheduler: Scheduler) -> None:
    def sync_open_read_close() -> tuple[LlmserveClient, int]:
        client = LlmserveClient(address(tiny_scheduler))
        stream = client.generate(prompt_token_ids=[3, 4, 5], max_tokens=400, ignore_eos=True)
        assert next(stream).completion_tokens >= 1
        step = first_scheduler(tiny_scheduler.engine)._next_step_id
        stream.close()  # the channel stays open: the generator's close alone cancels the call
        return client, step

    client, step = await asyncio.to_thread(sync_open_read_close)
    await assert_request_gone_within_steps(tiny_scheduler, step)
    client.close()

    async with AsyncLlmserveClient(address(tiny_scheduler)) as aclient:
        stream = aclient.generate(prompt_token_ids=[3, 4, 5], max_tokens=400, ignore_eos=True)
        assert (await anext(stream)).completion_tokens >= 1
        step = first_scheduler(tiny_scheduler.engine)._next_step_id
        await stream.aclose()
        await assert_request_gone_within_steps(tiny_scheduler, step)


# --- Abort, Tokenize, Detokenize, GetModelInfo, GetLoad ----------------------------------------


async def test_model_info_and_load(tiny_scheduler: Scheduler, tiny_worker: WorkerProcess) -> None:
    def sync_calls() -> tuple[pb.ModelInfo, pb.Load]:
        with LlmserveClient(address(tiny_scheduler)) as client:
            return client.model_info(), client.load()

    info, load = await asyncio.to_thread(sync_calls)
    async with AsyncLlmserveClient(address(tiny_scheduler)) as client:
        assert await client.model_info() == info
        async_load = await client.load()
    assert info.max_model_len == tiny_scheduler.engine.limits.max_model_len
    assert info.vocab_size == 49152
    assert info.block_size == 16
    for idle in (load, async_load):
        assert (idle.running, idle.waiting, idle.swapped) == (0, 0, 0)
        groups = [(g.address, g.num_gpu_blocks, g.free_gpu_blocks) for g in idle.groups]
        assert groups == [(tiny_worker.address, 64, 64)]


async def test_tokenize_and_detokenize_round_trip(tiny_scheduler: Scheduler) -> None:
    text = "Hello there, how are you?"
    expected = tiny_scheduler.engine.tokenizer.encode(text)

    def sync_calls() -> tuple[pb.TokenizeResponse, str]:
        with LlmserveClient(address(tiny_scheduler)) as client:
            tokens = client.tokenize(text)
            return tokens, client.detokenize(tokens.token_ids)

    tokens, back = await asyncio.to_thread(sync_calls)
    assert list(tokens.token_ids) == expected and len(tokens.tokens) == len(expected)
    assert back == text
    async with AsyncLlmserveClient(address(tiny_scheduler)) as client:
        plain = tiny_scheduler.engine.tokenizer.encode(text, add_special_tokens=False)
        assert list((await client.tokenize(text, add_special_tokens=False)).token_ids) == plain
        assert await client.detokenize(expected, skip_special_tokens=True) == text


async def test_abort_ends_the_stream_with_cancelled(tiny_scheduler: Scheduler) -> None:
    async with AsyncLlmserveClient(address(tiny_scheduler)) as client:
        stream = client.generate(prompt_token_ids=[3, 4, 5], ignore_eos=True, request_id="client-abort-me")
        assert (await anext(stream)).request_id == "client-abort-me"
        assert await client.abort(["client-abort-me", "never-sent"]) == ["client-abort-me"]
        with pytest.raises(grpc.RpcError) as caught:
            async for _ in stream:
                pass
        assert caught.value.code() == grpc.StatusCode.CANCELLED

    def sync_abort() -> list[str]:
        with LlmserveClient(address(tiny_scheduler)) as client:
            return client.abort(["never-sent"])

    assert await asyncio.to_thread(sync_abort) == []


@pytest.fixture(scope="module")
def chat_model_dir(tiny_model_dir: Path, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model plus SmolLM2's chat template, under the same name so the tiny worker
    passes the scheduler's handshake (the template is read by the scheduler only)."""
    out = tmp_path_factory.mktemp("chat") / tiny_model_dir.name
    out.mkdir()
    for path in tiny_model_dir.iterdir():
        (out / path.name).symlink_to(path)
    shutil.copy(smollm2_dir / "chat_template.jinja", out / "chat_template.jinja")
    return out


@pytest.fixture
async def chat_scheduler(chat_model_dir: Path, tiny_worker: WorkerProcess) -> AsyncIterator[Scheduler]:
    s = await start_scheduler(chat_model_dir, tiny_worker.address)
    await s.wait_ready()
    try:
        yield s
        await s.wait_idle()
    finally:
        await stop_scheduler(s)


async def test_chat_messages_are_rendered_like_tokenize_renders_them(chat_scheduler: Scheduler) -> None:
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
    async with AsyncLlmserveClient(address(chat_scheduler)) as client:
        rendered = await client.tokenize(messages=chat)
        by_messages = [m async for m in client.generate(messages=chat, max_tokens=5, ignore_eos=True)]
        by_ids = await client.generate_text(prompt_token_ids=rendered.token_ids, max_tokens=5, ignore_eos=True)
    assert "<|im_start|>" in rendered.tokens and len(rendered.token_ids) > 10
    assert by_messages[-1].prompt_tokens == len(rendered.token_ids)
    assert "".join(m.text for m in by_messages) == by_ids


async def test_the_generate_command_chats_like_the_client(chat_scheduler: Scheduler) -> None:
    """`llmserve generate --chat --system` sends the same conversation the client does."""
    import sys

    from tests.conftest import REPO

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
    async with AsyncLlmserveClient(address(chat_scheduler)) as client:
        expected = await client.generate_text(messages=chat, max_tokens=6, ignore_eos=True)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "llmserve.cli",
        "generate",
        "Hi there!",
        "--chat",
        "--system",
        "Be brief.",
        "--address",
        address(chat_scheduler),
        "--max-tokens",
        "6",
        "--ignore-eos",
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert out.decode() == expected + "\n"
    assert "6 generated, finish: length" in err.decode()
