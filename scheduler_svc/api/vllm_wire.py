"""The gateway protocol's protobuf edge (`vllm.grpc.engine.VllmEngine`, stubs from smg-grpc-proto):
the only module touching its message types.

Requests are checked against what llmserve supports and translated to our terms (a
`GenerateCall` holding a `GenerationRequest`); outputs, loads and cache events are translated
back. An option we cannot honour is refused with UNIMPLEMENTED naming it, never ignored.
Fields are named as the gateway sends them (`sampling_params.top_p`), in our errors too:
the engine's own checks name our API's fields, so `renamed` translates them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from common.errors import InvalidArgument, Unimplemented
from scheduler_svc.engine.kv_event_log import CacheCleared, KvBatch
from scheduler_svc.engine.load import GroupActivity, ModelInfo
from scheduler_svc.engine.request import GenerationRequest, RequestOutput, TokenLogprob
from scheduler_svc.kv.kv_events import BlockRemoved, BlockStored
from scheduler_svc.sched.sequence import FinishReason
from scheduler_svc.text.structured_output import StructuredOutput
from scheduler_svc.text.tokenizer_bundle import TokenizerBundle

SERVER_TYPE = "llmserve"
TOKENIZER_CHUNK_BYTES = 64 * 1024  # well under gRPC's default 4 MiB message limit
# vLLM's SamplingParams default: temperature unset means 1.0, not greedy.
DEFAULT_TEMPERATURE = 1.0

_FINISH = {
    FinishReason.LENGTH: "length",
    # vLLM reports running into the context as "length" too.
    FinishReason.CONTEXT_LENGTH: "length",
    FinishReason.STOP: "stop",
    FinishReason.STOP_SEQUENCE: "stop",
    FinishReason.ABORTED: "abort",
}
ABORT = "abort"


@dataclass(frozen=True)
class GenerateCall:
    """A GenerateRequest, checked. `request` carries no prompt yet: the servicer tokenizes
    `text` (or takes `token_ids`) and truncates it first."""

    text: str | None  # None: the input came tokenized
    token_ids: tuple[int, ...]
    stream: bool
    truncate_prompt_tokens: int | None  # keep the last N prompt tokens; -1 = as many as the context allows
    request: GenerationRequest

    @property
    def num_logprobs(self) -> int | None:
        return self.request.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        return self.request.prompt_logprobs


# ---- requests ----


def generate_call(msg: pb.GenerateRequest) -> GenerateCall:
    form = msg.WhichOneof("input")
    if form is None:
        raise InvalidArgument("input", "set tokenized or text")
    for name, used in (
        ("mm_inputs", msg.HasField("mm_inputs")),
        ("extra_mm_inputs", bool(msg.extra_mm_inputs)),
        ("media_refs", msg.HasField("media_refs")),
    ):
        if used:
            raise Unimplemented(f"{name}: multimodal inputs are not supported (text-only models)")
    for name, used in (
        ("kv_transfer_params", msg.HasField("kv_transfer_params")),
        ("kv_transfer_params_json", msg.HasField("kv_transfer_params_json")),
    ):
        if used:
            raise Unimplemented(f"{name}: prefill/decode disaggregation (KV transfer) is not supported")
    if msg.HasField("data_parallel_rank") and msg.data_parallel_rank != 0:
        raise InvalidArgument(
            "data_parallel_rank",
            f"this server is one data-parallel rank (0) and balances its worker groups itself, got {msg.data_parallel_rank}",
        )
    p = msg.sampling_params
    truncate = p.truncate_prompt_tokens if p.HasField("truncate_prompt_tokens") else None
    if truncate is not None and truncate < 1 and truncate != -1:
        raise InvalidArgument(
            "sampling_params.truncate_prompt_tokens", f"must be >= 1, or -1 for the model's context, got {truncate}"
        )
    return GenerateCall(
        text=msg.text if form == "text" else None,
        token_ids=tuple(msg.tokenized.input_ids) if form == "tokenized" else (),
        stream=msg.stream,
        truncate_prompt_tokens=truncate,
        request=generation_request(msg.request_id, p),
    )


def generation_request(request_id: str, p: pb.SamplingParams) -> GenerationRequest:
    if p.HasField("max_tokens") and p.max_tokens == 0:
        raise InvalidArgument("sampling_params.max_tokens", "must be at least 1 (unset: up to the end of the context)")
    for name in ("logprobs", "prompt_logprobs"):
        if p.HasField(name) and getattr(p, name) < 0:
            raise InvalidArgument(
                f"sampling_params.{name}",
                f"must be >= 0 (-1, the whole vocabulary, is not supported), got {getattr(p, name)}",
            )
    return GenerationRequest(
        request_id=request_id,
        temperature=p.temperature if p.HasField("temperature") else DEFAULT_TEMPERATURE,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
        repetition_penalty=p.repetition_penalty,
        max_tokens=p.max_tokens if p.HasField("max_tokens") else 0,
        min_tokens=p.min_tokens,
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        n=p.n,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        # int32 on the wire; our seeds are 64-bit: a negative one is read as its unsigned bits.
        seed=p.seed & 0xFFFFFFFF if p.HasField("seed") else None,
        include_stop_str_in_output=p.include_stop_str_in_output,
        logit_bias=tuple(sorted(p.logit_bias.items())),
        skip_special_tokens=p.skip_special_tokens,
        structured_output=structured_output(p),
        # spaces_between_special_tokens only changes text, which this protocol does not carry
        # (the gateway detokenizes); stop strings are matched as a fast tokenizer decodes.
    )


def structured_output(p: pb.SamplingParams) -> StructuredOutput | None:
    """The `constraint` oneof as the engine's StructuredOutput (json_object false: none).

    grammar_from_first_token needs no handling: with no reasoning parser here, every
    constraint starts at the first generated token anyway."""
    kind = p.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not p.json_object):
        return None
    if kind == "structural_tag":
        raise Unimplemented(
            "sampling_params.structural_tag: structural tags are not supported "
            "(json_schema, regex, grammar, json_object and choice are)"
        )
    if kind == "choice":
        return StructuredOutput("choice", choices=tuple(p.choice.choices), field="sampling_params")
    return StructuredOutput(kind, "" if kind == "json_object" else getattr(p, kind), field="sampling_params")


def renamed(error: InvalidArgument, text_input: bool) -> InvalidArgument:
    """The engine's error, naming the field as this protocol spells it."""
    message = str(error)[len(error.field) + 2 :]
    return InvalidArgument(field_name(error.field, text_input), message)


def field_name(ours: str, text_input: bool) -> str:
    if ours == "prompt":
        return "text" if text_input else "tokenized.input_ids"
    if ours.startswith("prompt_token_ids"):
        return "tokenized.input_ids" + ours[len("prompt_token_ids") :]
    if ours == "sampling.best_of":  # n samples are n candidates here
        return "sampling_params.n"
    for prefix in ("sampling.", "stopping."):
        if ours.startswith(prefix):
            return "sampling_params." + ours[len(prefix) :]
    return ours


# ---- generation responses ----


def finish_reason(out: RequestOutput) -> str:
    return _FINISH[out.finish_reason] if out.finish_reason is not None else ""


def matched_stop(out: RequestOutput, stop_token_ids: Sequence[int]) -> int | str | None:
    """What ended the output: a stop string, or a token the request listed in stop_token_ids.

    As in vLLM, the model's own eos ends an output with "stop" but matches nothing.
    """
    if out.finish_reason is FinishReason.STOP_SEQUENCE:
        return out.stop_sequence
    if out.finish_reason is FinishReason.STOP and out.stop_token_id in stop_token_ids:
        return out.stop_token_id
    return None


def output_logprobs(entries: Sequence[TokenLogprob], num: int) -> pb.OutputLogProbs:
    """Each token's log-probability and, when num > 0, its num most likely alternatives."""
    return pb.OutputLogProbs(
        token_logprobs=[e.logprob for e in entries],
        token_ids=[e.token_id for e in entries],
        top_logprobs=[_top(e.top[:num]) for e in entries] if num else [],
    )


def input_logprobs(prompt_ids: Sequence[int], entries: Sequence[TokenLogprob], num: int) -> pb.InputLogProbs:
    """Every prompt token; the first has no log-probability (nothing precedes it)."""
    values = [pb.InputTokenLogProb()] + [pb.InputTokenLogProb(value=e.logprob) for e in entries]
    return pb.InputLogProbs(
        token_logprobs=values,
        token_ids=[int(t) for t in prompt_ids],
        top_logprobs=[pb.TopLogProbs()] + [_top(e.top[:num]) for e in entries] if num else [],
    )


def _top(pairs: Sequence[tuple[int, float]]) -> pb.TopLogProbs:
    return pb.TopLogProbs(token_ids=[t for t, _ in pairs], values=[v for _, v in pairs])


def chunk(
    out: RequestOutput,
    logprobs: pb.OutputLogProbs | None,
    prompt_logprobs: pb.InputLogProbs | None,
) -> pb.GenerateResponse:
    """The new tokens of one output (`completion_tokens`: its total so far)."""
    return pb.GenerateResponse(
        chunk=pb.GenerateStreamChunk(
            token_ids=out.token_ids,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens,
            output_logprobs=logprobs,
            input_logprobs=prompt_logprobs,
            index=out.index,
        )
    )


def complete(
    index: int,
    output_ids: Sequence[int],
    reason: str,
    prompt_tokens: int,
    cached_tokens: int,
    matched: int | str | None = None,
    logprobs: pb.OutputLogProbs | None = None,
    prompt_logprobs: pb.InputLogProbs | None = None,
) -> pb.GenerateResponse:
    """The end of one output: every token it produced, and why it ended."""
    msg = pb.GenerateComplete(
        output_ids=output_ids,
        finish_reason=reason,
        prompt_tokens=prompt_tokens,
        completion_tokens=len(output_ids),
        cached_tokens=cached_tokens,
        output_logprobs=logprobs,
        input_logprobs=prompt_logprobs,
        index=index,
    )
    if isinstance(matched, str):
        msg.matched_stop_str = matched
    elif matched is not None:
        msg.matched_token_id = matched
    return pb.GenerateResponse(complete=msg)


# ---- management ----


def health(ready: bool, draining: bool) -> pb.HealthCheckResponse:
    if draining:
        return pb.HealthCheckResponse(healthy=False, message="draining: the server is shutting down")
    if not ready:
        return pb.HealthCheckResponse(healthy=False, message="no ready worker: warming up, or the worker is down")
    return pb.HealthCheckResponse(healthy=True, message="serving")


def model_info(
    info: ModelInfo, model_path: str, model_type: str, architectures: Sequence[str], bos: int | None, pad: int | None
) -> pb.GetModelInfoResponse:
    limits = info.limits
    return pb.GetModelInfoResponse(
        model_path=model_path,
        is_generation=True,
        max_context_length=info.max_model_len,
        vocab_size=info.vocab_size,
        supports_vision=False,
        served_model_name=info.model_name,
        tokenizer_path=model_path,
        model_type=model_type,
        architectures=list(architectures),
        eos_token_ids=list(info.eos_token_ids),
        pad_token_id=pad or 0,
        bos_token_id=bos or 0,
        # A prompt must leave room for at least one generated token.
        max_req_input_len=limits.max_prompt_tokens or info.max_model_len - 1,
        # Requests get no defaults from generation_config.json: nothing to report.
        default_sampling_params_json="",
    )


def server_info(
    active_requests: int,
    draining: bool,
    last_receive_timestamp: float,
    uptime_seconds: float,
    block_size: int,
    max_num_seqs: int,
    model_dtype: str,
) -> pb.GetServerInfoResponse:
    return pb.GetServerInfoResponse(
        active_requests=active_requests,
        is_paused=draining,
        last_receive_timestamp=last_receive_timestamp,
        uptime_seconds=uptime_seconds,
        server_type=SERVER_TYPE,
        # The scheduler balances its worker groups itself: to a gateway it is one engine.
        data_parallel_size=1,
        block_size=block_size,
        model_dtype=model_dtype,
        max_num_seqs=max_num_seqs,
    )


def loads(activity: Sequence[GroupActivity], dp_rank: int | None, timestamp: str, version: str) -> pb.GetLoadsResponse:
    """One SchedulerLoad per worker group (`dp_rank` = its position among the serving groups)."""
    ranked = [(rank, a) for rank, a in enumerate(activity) if dp_rank is None or rank == dp_rank]
    return pb.GetLoadsResponse(
        timestamp=timestamp,
        version=version,
        dp_rank_count=len(activity),
        loads=[_scheduler_load(rank, a) for rank, a in ranked],
    )


def _scheduler_load(rank: int, a: GroupActivity) -> pb.SchedulerLoad:
    g = a.load
    used = g.num_gpu_blocks - g.free_gpu_blocks  # cached prefix blocks count as free
    return pb.SchedulerLoad(
        dp_rank=rank,
        num_running_reqs=g.running,
        num_waiting_reqs=g.waiting + g.swapped,
        num_total_reqs=g.running + g.waiting + g.swapped,
        num_used_tokens=used * a.block_size,
        max_total_num_tokens=g.num_gpu_blocks * a.block_size,
        token_usage=used / g.num_gpu_blocks if g.num_gpu_blocks else 0.0,
        gen_throughput=a.output_tokens_per_s,
        cache_hit_rate=a.prefix_hit_tokens / a.prefix_queried_tokens if a.prefix_queried_tokens else 0.0,
        utilization=g.running / a.max_running if a.max_running else 0.0,
        max_running_requests=a.max_running,
        num_waiting_uncached_tokens=a.waiting_uncached_tokens,
    )


def flush_response(forgotten: int, busy_groups: int, in_flight: int) -> common_pb2.FlushCacheResponse:
    if busy_groups:
        return common_pb2.FlushCacheResponse(
            success=False,
            message=f"{in_flight} requests in flight hold KV blocks: nothing was flushed in {busy_groups} worker "
            f"group(s) (set timeout_s to wait for them); {forgotten} cached blocks were flushed elsewhere",
        )
    return common_pb2.FlushCacheResponse(success=True, message=f"flushed {forgotten} cached prefix blocks")


def tokenizer_chunks(
    bundle: TokenizerBundle, size: int = TOKENIZER_CHUNK_BYTES
) -> Iterator[common_pb2.GetTokenizerChunk]:
    """The zip in pieces; the last one carries the SHA-256 of the whole archive."""
    data = bundle.data
    for start in range(0, len(data), size):
        last = start + size >= len(data)
        yield common_pb2.GetTokenizerChunk(data=data[start : start + size], sha256=bundle.sha256 if last else "")


def kv_batch(batch: KvBatch) -> common_pb2.KvEventBatch:
    """A batch of cache events; consecutive stores of one chain share a KvBlocksStored."""
    events: list[common_pb2.KvCacheEvent] = []
    chain: list[BlockStored] = []

    def close_chain() -> None:
        if chain:
            stored = common_pb2.KvBlocksStored(
                blocks=[
                    common_pb2.KvBlock(
                        block_hash=s.block_hash, token_ids=[int(t) for t in s.token_ids], block_size=len(s.token_ids)
                    )
                    for s in chain
                ],
                tier=common_pb2.KV_CACHE_TIER_DEVICE,
            )
            if chain[0].parent_hash is not None:
                stored.parent_block_hash = chain[0].parent_hash
            events.append(common_pb2.KvCacheEvent(stored=stored))
            chain.clear()

    for event in batch.events:
        if isinstance(event, BlockStored):
            if chain and event.parent_hash != chain[-1].block_hash:
                close_chain()
            chain.append(event)
            continue
        close_chain()
        if isinstance(event, BlockRemoved):
            events.append(
                common_pb2.KvCacheEvent(
                    removed=common_pb2.KvBlocksRemoved(
                        block_hashes=[event.block_hash], tier=common_pb2.KV_CACHE_TIER_DEVICE
                    )
                )
            )
        elif isinstance(event, CacheCleared):
            events.append(common_pb2.KvCacheEvent(cleared=common_pb2.KvCacheCleared()))
    close_chain()
    return common_pb2.KvEventBatch(sequence_number=batch.sequence_number, timestamp=batch.timestamp, events=events)
