"""`fmaas.GenerationService` (the TGIS API) over the same engine as `llmserve.v1.Generation`.

A thin adapter: check and translate the TGIS request (`tgis_wire`), tokenize the prompt here
(TGIS reports input token counts and truncates prompts on request), run our engine, translate
the outputs back. Errors are our domain errors, mapped to status codes by the server's
`ErrorInterceptor` like those of the native API.

    GenerateStream:  head (input_token_count, seed, echoed input)   after the first output
                     one message per engine output (new text, generated_token_count)
                     the last one with stop_reason (TIME_LIMIT when time_limit_millis ran out)

The head waits for the first output so that a refused request fails before any message,
as with TGIS. `model_id` is not checked: a TGIS server serves one model, and clients send
their own name for it.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing

import grpc

from common.pb.fmaas import generation_pb2 as pb
from common.pb.fmaas import generation_pb2_grpc
from scheduler_svc.api import tgis_wire
from scheduler_svc.api.generation_servicer import bind_trace, end_cause, owned, trace_headers
from scheduler_svc.api.tgis_wire import TgisParams, TimeLimit
from scheduler_svc.engine.engine import Engine
from scheduler_svc.engine.request import GenerationRequest, RequestOutput, TokenLogprob
from scheduler_svc.text.input_limits import check_text_bytes

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name


class TgisServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: pb.BatchedGenerationRequest, context: grpc.aio.ServicerContext
    ) -> pb.BatchedGenerationResponse:
        headers = trace_headers(context)
        bind_trace(headers)  # the prompts' tasks copy them: each prompt's lines carry the caller's ids
        texts, params = tgis_wire.batched_request(request, self._engine.config.max_queue_len)
        deadline = _deadline(params)
        if headers:
            await context.send_initial_metadata(tuple(headers.items()))
        cause = _end_cause(context, deadline)
        tasks = [asyncio.ensure_future(self._generate_one(text, params, deadline, cause)) for text in texts]
        try:
            responses = await asyncio.gather(*tasks)
        except BaseException:
            # One prompt refused or failed (or the call was cancelled): abort the others too.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return pb.BatchedGenerationResponse(responses=responses)

    async def _generate_one(
        self, text: str, params: TgisParams, deadline: float | None, cause: Callable[[], str]
    ) -> pb.GenerationResponse:
        prompt_ids, seed, req = await self._request(text, params)
        outputs: list[RequestOutput] = []
        end: RequestOutput | TimeLimit | None = None
        async with aclosing(_run(self._engine.generate(req, cause), deadline)) as stream:
            async for out in stream:
                if isinstance(out, RequestOutput):
                    outputs.append(out)
                end = out
        if end is None:  # pragma: no cover (the engine always ends a stream with a finish reason)
            raise RuntimeError("the engine ended a generation without output")
        output_ids = [t for o in outputs for t in o.token_ids]
        output_details: list[TokenLogprob | None] = [d for o in outputs for d in o.logprobs]
        return tgis_wire.generation_response(
            params,
            text,
            len(prompt_ids),
            self._input_infos(params, prompt_ids, outputs[0] if outputs else None),
            outputs,
            end,
            self._infos(params, output_ids, output_details) if params.generated_tokens else [],
            seed,
        )

    async def GenerateStream(  # noqa: N802 (gRPC method name)
        self, request: pb.SingleGenerationRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerationResponse]:
        headers = trace_headers(context)
        bind_trace(headers)
        text, params = tgis_wire.single_request(request)
        deadline = _deadline(params)
        prompt_ids, seed, req = await self._request(text, params)
        if headers:
            await context.send_initial_metadata(tuple(headers.items()))
        async for message in self._stream(text, params, prompt_ids, seed, req, deadline, _end_cause(context, deadline)):
            yield message

    async def _stream(
        self,
        text: str,
        params: TgisParams,
        prompt_ids: list[int],
        seed: int | None,
        req: GenerationRequest,
        deadline: float | None,
        cause: Callable[[], str],
    ) -> AsyncIterator[pb.GenerationResponse]:
        head = False
        async with aclosing(_run(self._engine.generate(req, cause), deadline)) as stream:
            async for out in stream:
                first = out if isinstance(out, RequestOutput) else None
                if not head:
                    head = True
                    input_tokens = self._input_infos(params, prompt_ids, first)
                    yield tgis_wire.stream_head(params, text, len(prompt_ids), input_tokens, seed)
                tokens = []
                if first is not None and params.generated_tokens:
                    tokens = self._infos(params, first.token_ids, list(first.logprobs))
                yield tgis_wire.stream_message(params, out, tokens)

    async def Tokenize(  # noqa: N802 (gRPC method name)
        self, request: pb.BatchedTokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.BatchedTokenizeResponse:
        call = tgis_wire.tokenize_request(request)
        check_text_bytes("requests", call.texts, self._engine.limits.request, "max_tokenize_bytes")
        results = []
        for enc in await self._engine.tokenizer.encodings_off_loop(list(call.texts)):
            keep = _keep(len(enc.ids), call.truncate_input_tokens)
            results.append((list(enc.tokens[keep:]), [(int(a), int(b)) for a, b in enc.offsets[keep:]]))
        return tgis_wire.tokenize_response(call, results)

    async def ModelInfo(  # noqa: N802 (gRPC method name)
        self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfoResponse:
        return tgis_wire.model_info_response(self._engine.limits.max_model_len)

    # ---- helpers ----

    async def _request(self, text: str, params: TgisParams) -> tuple[list[int], int | None, GenerationRequest]:
        """The prompt's tokens (truncated as asked), the seed used, and our request."""
        ids = await self._engine.prompt_tokens(text, (), ()) if text else []
        ids = ids[_keep(len(ids), params.truncate_input_tokens) :]
        # Drawn here rather than by the engine so the response can report it, as TGIS does.
        seed = (params.seed if params.seed is not None else secrets.randbits(63)) if params.sample else None
        return ids, seed, owned(params.generation_request(ids, self._engine.limits.max_model_len, seed))

    def _text_of(self, token: int) -> str:
        return self._engine.tokenizer.token_strings([token])[0]

    def _infos(self, params: TgisParams, ids: list[int], details: list[TokenLogprob | None]) -> list[pb.TokenInfo]:
        return tgis_wire.token_infos(params, self._engine.tokenizer.token_strings(ids), details, self._text_of)

    def _input_infos(
        self, params: TgisParams, prompt_ids: list[int], first: RequestOutput | None
    ) -> list[pb.TokenInfo]:
        """The prompt's tokens, with their scores (which the first output carries) when asked."""
        if not params.input_tokens:
            return []
        details: list[TokenLogprob | None] = [None, *first.prompt_logprobs] if first is not None else []
        return self._infos(params, prompt_ids, details)


def _keep(num_tokens: int, truncate: int) -> int:
    """Start of the kept tokens: TGIS truncates on the left, keeping the prompt's end."""
    return max(num_tokens - truncate, 0) if truncate else 0


def _deadline(params: TgisParams) -> float | None:
    """When time_limit_millis runs out, on the event loop's clock."""
    return None if params.time_limit is None else asyncio.get_running_loop().time() + params.time_limit


def _end_cause(context: grpc.aio.ServicerContext, deadline: float | None) -> Callable[[], str]:
    """Why the request ended early, for its request_aborted line: time_limit_millis ran out
    (`_run` aborts it), else why the caller went away (`end_cause`: deadline, cancelled)."""
    caller = end_cause(context)

    def cause() -> str:
        if deadline is not None and asyncio.get_running_loop().time() >= deadline:
            return "time_limit"
        return caller()

    return cause


async def _run(
    outputs: AsyncIterator[RequestOutput], deadline: float | None
) -> AsyncGenerator[RequestOutput | TimeLimit, None]:
    """The engine's outputs until `deadline`; then the request is aborted and a TimeLimit ends it.

    The timeout cancels the wait inside the engine's generator, whose cleanup aborts the
    request (its blocks are freed at the next step), exactly as a client cancel does.
    """
    generated = 0
    try:
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    out = await anext(outputs)
            except StopAsyncIteration:
                return
            except TimeoutError:
                yield TimeLimit(generated)
                return
            generated = out.completion_tokens
            yield out
    finally:
        if isinstance(outputs, AsyncGenerator):
            await outputs.aclose()


def register(server: grpc.aio.Server, engine: Engine) -> None:
    """Serve the TGIS API on `server`, next to the native one."""
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(TgisServicer(engine), server)
