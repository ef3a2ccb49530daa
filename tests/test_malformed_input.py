"""Input no client library would send: bytes that are no message, request ids that cannot be
metadata. Each is refused with a documented status, the server keeps serving and no block leaks."""

from __future__ import annotations

import grpc
import pytest

from common.pb.llmserve.v1 import generation_pb2 as pb
from tests.conftest import Scheduler

# Undecodable as any message: field 1 with wire type 7, which does not exist.
GARBAGE = b"\x0f\xff\xff\xff"

METHODS = [
    ("/llmserve.v1.Generation/Generate", "stream"),
    ("/llmserve.v1.Generation/Tokenize", "unary"),
    ("/fmaas.GenerationService/Generate", "unary"),
    ("/fmaas.GenerationService/GenerateStream", "stream"),
    ("/vllm.grpc.engine.VllmEngine/Generate", "stream"),
    ("/vllm.grpc.engine.VllmEngine/GetModelInfo", "unary"),
]


async def _ok(s: Scheduler) -> None:
    request = pb.GenerateRequest(prompt_token_ids=[5, 6, 7], stopping=pb.StoppingCriteria(max_tokens=2))
    tokens = [t async for m in s.stub.Generate(request) for t in m.token_ids]
    assert len(tokens) == 2


@pytest.mark.parametrize(("method", "shape"), METHODS)
async def test_undecodable_bytes_are_invalid_argument(tiny_scheduler: Scheduler, method: str, shape: str) -> None:
    call = (tiny_scheduler.channel.unary_stream if shape == "stream" else tiny_scheduler.channel.unary_unary)(method)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        if shape == "stream":
            [m async for m in call(GARBAGE, timeout=10)]
        else:
            await call(GARBAGE, timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert "does not parse" in (caught.value.details() or "")
    await _ok(tiny_scheduler)


@pytest.mark.parametrize("request_id", ["line\nbreak", "é-accent", "tab\there", "x" * 257])
async def test_request_ids_that_cannot_be_metadata_are_refused(tiny_scheduler: Scheduler, request_id: str) -> None:
    request = pb.GenerateRequest(
        request_id=request_id, prompt_token_ids=[5, 6], stopping=pb.StoppingCriteria(max_tokens=2)
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [m async for m in tiny_scheduler.stub.Generate(request, timeout=10)]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert "request_id" in (caught.value.details() or "")
    await _ok(tiny_scheduler)


async def test_a_printable_request_id_is_echoed(tiny_scheduler: Scheduler) -> None:
    request = pb.GenerateRequest(
        request_id="job 7/a:b", prompt_token_ids=[5, 6], stopping=pb.StoppingCriteria(max_tokens=1)
    )
    call = tiny_scheduler.stub.Generate(request, timeout=10)
    [m async for m in call]
    assert dict(await call.initial_metadata())["x-request-id"] == "job 7/a:b"
