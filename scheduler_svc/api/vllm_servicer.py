"""`vllm.grpc.engine.VllmEngine` (the smg gateway's engine protocol) over the same engine as
`llmserve.v1.Generation`.

A thin adapter: check and translate the request (`vllm_wire`), tokenize and truncate the
prompt here (truncation is on request), run our engine, translate the outputs back. The
gateway tokenizes and detokenizes itself, so outputs are token ids, never text:

    stream = true:   chunk (new token ids of output i) ... complete (output i: all its ids,
                     finish_reason, matched stop) -- outputs of n > 1 interleave, by index
    stream = false:  one complete per output, in index order, when the request ends

An `Abort` ends the request's stream with "abort" completes (vLLM's behaviour), not with an
error; a cancelled call aborts the request like any other API, and its blocks are freed at
the next step. Errors are our domain errors, mapped to status codes by the server's
`ErrorInterceptor`, with fields named as this protocol spells them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from importlib import metadata

import grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from common.errors import Cancelled, InvalidArgument, Unavailable, Unimplemented
from common.grpc import auth
from scheduler_svc.api import vllm_kv_wire, vllm_state_wire, vllm_wire
from scheduler_svc.api.generation_servicer import abort_scope, bind_trace, end_cause, owned, trace_headers
from scheduler_svc.api.vllm_wire import GenerateCall
from scheduler_svc.engine.engine import Engine
from scheduler_svc.engine.request import GenerationRequest, RequestOutput, TokenLogprob
from scheduler_svc.text.tokenizer_bundle import TokenizerBundle, build_bundle

# Highest SubscribeKvEvents cursor accepted, plus one (batch numbers are uint64).
MAX_KV_CURSOR = 2**63
# Call metadata with which an admin's SubscribeKvEvents asks for the blocks' token ids.
KV_TOKEN_IDS_HEADER = "x-llmserve-kv-token-ids"
# Every caller of the gateway's listener (scheduler_svc/api/server.py): smg, which dials without
# credentials, so the listener is bound where only the gateway reaches it.
GATEWAY = auth.Caller("gateway", admin=True)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
FLUSH_POLL_S = 0.02


def _version() -> str:
    try:
        return metadata.version("llmserve")
    except metadata.PackageNotFoundError:  # pragma: no cover (run from a source tree)
        return ""


@dataclass
class _Output:
    """What one output (index) has produced so far."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    last: RequestOutput | None = None
    sent_prompt_logprobs: bool = False

    def add(self, out: RequestOutput) -> None:
        self.token_ids.extend(out.token_ids)
        self.logprobs.extend(out.logprobs)
        self.last = out

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finish_reason is not None


class VllmEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._started = time.monotonic()
        self._last_receive = 0.0
        self._kv_log = engine.kv_event_log
        self._bundle: TokenizerBundle | None = None

    # ---- generation ----

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        self._last_receive = time.time()
        headers = trace_headers(context)
        bind_trace(headers)
        call = vllm_wire.generate_call(request)
        prompt = await self._prompt(call)
        req = owned(replace(call.request, prompt_token_ids=tuple(prompt)))
        if headers:
            await context.send_initial_metadata(tuple(headers.items()))
        async for message in self._generate(call, req, prompt, end_cause(context)):
            yield message

    async def _prompt(self, call: GenerateCall) -> list[int]:
        """The prompt's token ids, truncated on the left as asked (vLLM keeps the prompt's end)."""
        if call.text is not None:
            if not call.text:
                raise InvalidArgument("text", "empty prompt")
            ids = await self._engine.prompt_tokens(call.text, (), ())
        else:
            ids = list(call.token_ids)
        keep = call.truncate_prompt_tokens
        if keep == -1:
            limits = self._engine.limits
            keep = limits.max_prompt_tokens or limits.max_model_len - 1
        return ids[-keep:] if keep else ids

    async def _generate(
        self, call: GenerateCall, req: GenerationRequest, prompt: list[int], cause: Callable[[], str]
    ) -> AsyncIterator[pb.GenerateResponse]:
        outputs: dict[int, _Output] = {}
        prompt_entries: tuple[TokenLogprob, ...] = ()
        aborted = False
        try:
            async for out in self._engine.generate(req, cause):
                prompt_entries = prompt_entries or out.prompt_logprobs
                state = outputs.setdefault(out.index, _Output())
                state.add(out)
                if call.stream:
                    yield vllm_wire.chunk(
                        out,
                        self._logprobs(call, out.logprobs),
                        self._first_prompt_logprobs(call, state, prompt, prompt_entries),
                    )
                    if out.finish_reason is not None:
                        yield self._complete(call, out.index, state, prompt, ())
        except InvalidArgument as error:
            raise vllm_wire.renamed(error, call.text is not None) from None
        except Cancelled:
            aborted = True  # by an Abort call: the outputs so far end with "abort"
        n = req.n or 1
        if call.stream:
            if aborted:
                for index in range(n):
                    state = outputs.setdefault(index, _Output())
                    if not state.finished:
                        yield self._complete(call, index, state, prompt, (), vllm_wire.ABORT)
            return
        for index in range(n):
            state = outputs.setdefault(index, _Output())
            yield self._complete(
                call, index, state, prompt, prompt_entries, None if state.finished else vllm_wire.ABORT
            )

    def _complete(
        self,
        call: GenerateCall,
        index: int,
        state: _Output,
        prompt: list[int],
        prompt_entries: tuple[TokenLogprob, ...],
        reason: str | None = None,
    ) -> pb.GenerateResponse:
        """Output `index`'s end. Streamed, its log-probabilities went with the chunks."""
        last = state.last
        whole = not call.stream
        return vllm_wire.complete(
            index=index,
            output_ids=state.token_ids,
            reason=reason or (vllm_wire.finish_reason(last) if last is not None else vllm_wire.ABORT),
            prompt_tokens=len(prompt),
            cached_tokens=last.cached_tokens if last is not None else 0,
            matched=vllm_wire.matched_stop(last, call.request.stop_token_ids)
            if last is not None and reason is None
            else None,
            logprobs=self._logprobs(call, state.logprobs) if whole else None,
            prompt_logprobs=self._prompt_logprobs(call, prompt, prompt_entries) if whole else None,
        )

    @staticmethod
    def _logprobs(
        call: GenerateCall, entries: tuple[TokenLogprob, ...] | list[TokenLogprob]
    ) -> pb.OutputLogProbs | None:
        return vllm_wire.output_logprobs(entries, call.num_logprobs) if call.num_logprobs is not None else None

    @staticmethod
    def _prompt_logprobs(
        call: GenerateCall, prompt: list[int], entries: tuple[TokenLogprob, ...]
    ) -> pb.InputLogProbs | None:
        if call.num_prompt_logprobs is None:
            return None
        return vllm_wire.input_logprobs(prompt, entries, call.num_prompt_logprobs)

    def _first_prompt_logprobs(
        self, call: GenerateCall, state: _Output, prompt: list[int], entries: tuple[TokenLogprob, ...]
    ) -> pb.InputLogProbs | None:
        """The prompt's log-probabilities, on the first chunk of each output (as vLLM sends them)."""
        if state.sent_prompt_logprobs:
            return None
        state.sent_prompt_logprobs = True
        return self._prompt_logprobs(call, prompt, entries)

    async def Abort(  # noqa: N802
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        self._engine.abort_requests(list(request.request_ids), abort_scope())
        return pb.AbortResponse()

    async def Embed(  # noqa: N802
        self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> pb.EmbedResponse:
        raise Unimplemented("Embed: this server serves generative models only; embeddings are not supported")

    # ---- state ----

    async def HealthCheck(  # noqa: N802
        self, request: pb.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthCheckResponse:
        return vllm_state_wire.health(self._engine.ready, self._engine.draining)

    async def GetModelInfo(  # noqa: N802
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        spec = self._engine.spec
        return vllm_state_wire.model_info(
            self._engine.model_info(),
            # Where the model lies on this server is for the gateway (and admins) only: a
            # gateway on the same machine reads the tokenizer from there.
            spec.path if auth.caller().admin else spec.public_name,
            spec.model_type,
            spec.architectures,
            spec.bos_token_id,
            spec.pad_token_id,
        )

    async def GetServerInfo(  # noqa: N802
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetServerInfoResponse:
        engine = self._engine
        info = next((r.info for r in engine.replicas if r.info is not None), None)
        return vllm_state_wire.server_info(
            active_requests=engine.num_requests,
            draining=engine.draining,
            last_receive_timestamp=self._last_receive,
            uptime_seconds=time.monotonic() - self._started,
            block_size=engine.block_size,
            max_num_seqs=engine.config.max_num_seqs,
            model_dtype=info.dtype if info is not None else "",
        )

    async def GetLoads(  # noqa: N802
        self, request: pb.GetLoadsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetLoadsResponse:
        activity = self._engine.activity()
        if not activity:
            raise Unavailable("no ready worker: the service is warming up or its worker is down")
        dp_rank = request.dp_rank if request.HasField("dp_rank") else None
        if dp_rank is not None and not 0 <= dp_rank < len(activity):
            raise InvalidArgument(
                "dp_rank", f"{dp_rank} is not one of the {len(activity)} worker groups (0..{len(activity) - 1})"
            )
        return vllm_state_wire.loads(activity, dp_rank, datetime.now(UTC).isoformat(), _version())

    async def GetTokenizer(  # noqa: N802
        self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        if self._bundle is None:
            # Zipping a few MB takes a moment: not on the event loop the engine runs on.
            self._bundle = await asyncio.to_thread(build_bundle, self._engine.spec.path)
        for chunk in vllm_state_wire.tokenizer_chunks(self._bundle):
            yield chunk

    # ---- prefix cache ----

    async def FlushCache(  # noqa: N802
        self, request: common_pb2.FlushCacheRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.FlushCacheResponse:
        engine = self._engine
        deadline = time.monotonic() + max(request.timeout_s, 0.0)
        while engine.num_requests and time.monotonic() < deadline:
            await asyncio.sleep(FLUSH_POLL_S)
        forgotten, busy = await engine.flush_prefix_cache()
        return vllm_kv_wire.flush_response(forgotten, busy, engine.num_requests)

    async def SubscribeKvEvents(  # noqa: N802
        self, request: common_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        if not self._engine.config.enable_prefix_caching:
            raise Unimplemented("SubscribeKvEvents: prefix caching is off on this server (--no-prefix-caching)")
        if request.start_sequence_number >= MAX_KV_CURSOR:
            # Batches after a cursor are numbered after it (a resync continues from it): one
            # this high would leave no room in the uint64. Ours count from microseconds since
            # the epoch, far below.
            raise InvalidArgument(
                "start_sequence_number",
                f"{request.start_sequence_number} is beyond any number this server hands out (< 2^63)",
            )
        token_ids = _sees_token_ids(context)
        # Load is not pushed on this stream (EngineLoad): the gateway keeps polling GetLoads.
        with self._kv_log.subscribe(request.start_sequence_number) as batches:
            # Headers now tell the subscriber that every later cache change reaches it.
            await context.send_initial_metadata(())
            async for batch in batches:
                yield vllm_kv_wire.kv_batch(batch, token_ids)

    # ---- profiling ----

    async def StartProfile(  # noqa: N802
        self, request: common_pb2.StartProfileRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ProfileResponse:
        raise Unimplemented(
            "StartProfile: profiling is not supported; run workers with --profile-steps for per-step timings"
        )

    async def StopProfile(  # noqa: N802
        self, request: common_pb2.StopProfileRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ProfileResponse:
        raise Unimplemented("StopProfile: profiling is not supported")


def _sees_token_ids(context: grpc.aio.ServicerContext) -> bool:
    """Whether this subscriber's cache events carry the blocks' token ids (other callers'
    prompts), not only their hashes. The interceptor let only admins this far. The gateway
    gets them (smg's cache-aware router hashes the token ids itself), and so does everyone on
    a server without keys (every caller is the same admin there, who could ask anyway); a
    keyed admin asks with the call metadata `KV_TOKEN_IDS_HEADER: 1`."""
    who = auth.caller()
    if who in (GATEWAY, auth.ANONYMOUS):
        return True
    asked = dict((k, v) for k, v in context.invocation_metadata() or () if isinstance(v, str))
    return who.admin and asked.get(KV_TOKEN_IDS_HEADER) == "1"


def register(server: grpc.aio.Server, engine: Engine, servicer: VllmEngineServicer | None = None) -> VllmEngineServicer:
    """Serve the gateway protocol on `server`, next to the native one; one servicer may serve
    several servers (the scheduler's port and the gateway's)."""
    servicer = servicer or VllmEngineServicer(engine)
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(servicer, server)
    return servicer
