"""A small typed client for `llmserve.v1.Generation`, blocking (`LlmserveClient`) and asyncio
(`AsyncLlmserveClient`), with the same methods.

    with LlmserveClient("127.0.0.1:50051") as client:
        for message in client.generate("The capital of France is", max_tokens=16):
            print(message.text, end="", flush=True)

    async with AsyncLlmserveClient("127.0.0.1:50051") as client:
        text = await client.generate_text(messages=[{"role": "user", "content": "Hi!"}], max_tokens=32)

Methods return the protobuf messages of `generation.proto` (whose comments document every field),
except where a response would wrap a single field: `abort` returns the aborted ids, `detokenize`
the text, `generate_text` the text of output 0. Failures are `grpc.RpcError`s carrying the
server's status code (`INVALID_ARGUMENT`, `UNAVAILABLE`, ...) and a message naming the field.
`generate` takes the common parameters; `stream` sends any `GenerateRequest` (logprobs, beams,
penalties) built with `generate_request` or by hand. Closing a stream (`close()`, `aclose()`, or
leaving a loop over it and dropping it) cancels the call, which aborts the request on the server.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Generator, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

import grpc

from common.grpc.auth import bearer_metadata
from common.pb.llmserve.v1 import generation_pb2 as pb
from common.pb.llmserve.v1 import generation_pb2_grpc

if TYPE_CHECKING:
    from typing import Self, Unpack  # Python 3.11; only the type checker needs them

DEFAULT_ADDRESS = "127.0.0.1:50051"

# A chat turn: {"role": "user", "content": "..."} or the protobuf message itself.
Message = Mapping[str, str] | pb.ChatMessage
ChannelOptions = Sequence[tuple[str, Any]]


def _chat(messages: Iterable[Message]) -> list[pb.ChatMessage]:
    return [
        m if isinstance(m, pb.ChatMessage) else pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages
    ]


def generate_request(
    prompt: str = "",
    *,
    prompt_token_ids: Sequence[int] = (),
    messages: Sequence[Message] = (),
    max_tokens: int = 0,
    temperature: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    n: int = 0,
    priority: int = 0,
    request_id: str = "",
) -> pb.GenerateRequest:
    """A `GenerateRequest`; zero values keep the proto's defaults (max_tokens 0 = no explicit
    limit, temperature 0 = greedy, top_p 0 = 1.0, n 0 = 1). Exactly one of prompt,
    prompt_token_ids and messages must be given; the server checks that and every range."""
    sampling = pb.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, n=n)
    if seed is not None:
        sampling.seed = seed
    return pb.GenerateRequest(
        request_id=request_id,
        prompt=prompt,
        prompt_token_ids=list(prompt_token_ids),
        messages=_chat(messages),
        sampling=sampling,
        stopping=pb.StoppingCriteria(
            max_tokens=max_tokens, stop=list(stop), stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos
        ),
        priority=priority,
    )


class GenerateParams(TypedDict, total=False):
    """The keyword arguments of `generate_request`, as accepted by every `generate*` method."""

    prompt_token_ids: Sequence[int]
    messages: Sequence[Message]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: Sequence[str]
    stop_token_ids: Sequence[int]
    ignore_eos: bool
    n: int
    priority: int
    request_id: str


def tokenize_request(text: str, messages: Sequence[Message], add_special_tokens: bool | None) -> pb.TokenizeRequest:
    request = pb.TokenizeRequest(text=text, messages=_chat(messages))
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    return request


def detokenize_request(token_ids: Sequence[int], skip_special_tokens: bool | None) -> pb.DetokenizeRequest:
    request = pb.DetokenizeRequest(token_ids=list(token_ids))
    if skip_special_tokens is not None:
        request.skip_special_tokens = skip_special_tokens
    return request


class LlmserveClient:
    """Blocking client over one channel: plaintext, or TLS with `secure` credentials
    (e.g. `grpc.ssl_channel_credentials(root_certificates=...)`); `api_key` for a server that
    asks for one. Thread-safe, like the channel."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        secure: grpc.ChannelCredentials | None = None,
        options: ChannelOptions = (),
        api_key: str | None = None,
    ) -> None:
        # Sent with every call: a server started with --api-key refuses calls without it.
        self._metadata = bearer_metadata(api_key)
        self._channel = (
            grpc.insecure_channel(address, options=options)
            if secure is None
            else grpc.secure_channel(address, secure, options=options)
        )
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    def stream(
        self, request: pb.GenerateRequest, *, timeout: float | None = None
    ) -> Generator[pb.GenerateResponse, None, None]:
        """Streams the responses to any `GenerateRequest`; closing the generator cancels the call."""
        call = self._stub.Generate(request, timeout=timeout, metadata=self._metadata)
        try:
            yield from call
        finally:
            call.cancel()  # a no-op once the stream has ended

    def generate(
        self, prompt: str = "", *, timeout: float | None = None, **params: Unpack[GenerateParams]
    ) -> Generator[pb.GenerateResponse, None, None]:
        """Streams a generation; `params` are those of `generate_request`."""
        return self.stream(generate_request(prompt, **params), timeout=timeout)

    def generate_text(self, prompt: str = "", *, timeout: float | None = None, **params: Unpack[GenerateParams]) -> str:
        """The whole text of output 0 of a generation."""
        return "".join(m.text for m in self.generate(prompt, timeout=timeout, **params) if m.index == 0)

    def abort(self, request_ids: Iterable[str], *, timeout: float | None = None) -> list[str]:
        """Aborts in-flight requests; returns the ids that were in flight (unknown ones are ignored)."""
        response = self._stub.Abort(
            pb.AbortRequest(request_ids=list(request_ids)), timeout=timeout, metadata=self._metadata
        )
        return list(response.aborted)

    def tokenize(
        self,
        text: str = "",
        *,
        messages: Sequence[Message] = (),
        add_special_tokens: bool | None = None,
        timeout: float | None = None,
    ) -> pb.TokenizeResponse:
        response: pb.TokenizeResponse = self._stub.Tokenize(
            tokenize_request(text, messages, add_special_tokens), timeout=timeout, metadata=self._metadata
        )
        return response

    def detokenize(
        self, token_ids: Sequence[int], *, skip_special_tokens: bool | None = None, timeout: float | None = None
    ) -> str:
        response = self._stub.Detokenize(
            detokenize_request(token_ids, skip_special_tokens), timeout=timeout, metadata=self._metadata
        )
        return str(response.text)

    def model_info(self, *, timeout: float | None = None) -> pb.ModelInfo:
        info: pb.ModelInfo = self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout, metadata=self._metadata)
        return info

    def load(self, *, timeout: float | None = None) -> pb.Load:
        load: pb.Load = self._stub.GetLoad(pb.GetLoadRequest(), timeout=timeout, metadata=self._metadata)
        return load

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncLlmserveClient:
    """The asyncio twin of `LlmserveClient` (grpc.aio); create it inside the running event loop."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        secure: grpc.ChannelCredentials | None = None,
        options: ChannelOptions = (),
        api_key: str | None = None,
    ) -> None:
        # Sent with every call: a server started with --api-key refuses calls without it.
        self._metadata = bearer_metadata(api_key)
        self._channel = (
            grpc.aio.insecure_channel(address, options=options)
            if secure is None
            else grpc.aio.secure_channel(address, secure, options=options)
        )
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    async def stream(
        self, request: pb.GenerateRequest, *, timeout: float | None = None
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """Streams the responses to any `GenerateRequest`; closing the generator cancels the call."""
        call = self._stub.Generate(request, timeout=timeout, metadata=self._metadata)
        try:
            async for message in call:
                yield message
        finally:
            call.cancel()  # a no-op once the stream has ended

    def generate(
        self, prompt: str = "", *, timeout: float | None = None, **params: Unpack[GenerateParams]
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """Streams a generation; `params` are those of `generate_request`."""
        return self.stream(generate_request(prompt, **params), timeout=timeout)

    async def generate_text(
        self, prompt: str = "", *, timeout: float | None = None, **params: Unpack[GenerateParams]
    ) -> str:
        """The whole text of output 0 of a generation."""
        return "".join([m.text async for m in self.generate(prompt, timeout=timeout, **params) if m.index == 0])

    async def abort(self, request_ids: Iterable[str], *, timeout: float | None = None) -> list[str]:
        """Aborts in-flight requests; returns the ids that were in flight (unknown ones are ignored)."""
        response = await self._stub.Abort(
            pb.AbortRequest(request_ids=list(request_ids)), timeout=timeout, metadata=self._metadata
        )
        return list(response.aborted)

    async def tokenize(
        self,
        text: str = "",
        *,
        messages: Sequence[Message] = (),
        add_special_tokens: bool | None = None,
        timeout: float | None = None,
    ) -> pb.TokenizeResponse:
        response: pb.TokenizeResponse = await self._stub.Tokenize(
            tokenize_request(text, messages, add_special_tokens), timeout=timeout, metadata=self._metadata
        )
        return response

    async def detokenize(
        self, token_ids: Sequence[int], *, skip_special_tokens: bool | None = None, timeout: float | None = None
    ) -> str:
        response = await self._stub.Detokenize(
            detokenize_request(token_ids, skip_special_tokens), timeout=timeout, metadata=self._metadata
        )
        return str(response.text)

    async def model_info(self, *, timeout: float | None = None) -> pb.ModelInfo:
        info: pb.ModelInfo = await self._stub.GetModelInfo(
            pb.GetModelInfoRequest(), timeout=timeout, metadata=self._metadata
        )
        return info

    async def load(self, *, timeout: float | None = None) -> pb.Load:
        load: pb.Load = await self._stub.GetLoad(pb.GetLoadRequest(), timeout=timeout, metadata=self._metadata)
        return load

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
