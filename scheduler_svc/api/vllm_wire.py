"""The gateway protocol's Generate edge (`vllm.grpc.engine.VllmEngine`, stubs from smg-grpc-proto):
requests in, outputs out, the only module touching those message types.

Requests are checked against what llmserve supports and translated to our terms (a
`GenerateCall` holding a `GenerationRequest`); outputs are translated back. An option we
cannot honour is refused with UNIMPLEMENTED naming it, never ignored. Fields are named as the
gateway sends them (`sampling_params.top_p`), in our errors too: the engine's own checks name
our API's fields, so `renamed` translates them. The protocol's state calls are
vllm_state_wire.py's and its prefix-cache calls vllm_kv_wire.py's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from common.errors import InvalidArgument, Unimplemented
from scheduler_svc.engine.request import GenerationRequest, RequestOutput, TokenLogprob
from scheduler_svc.sched.sequence import FinishReason
from scheduler_svc.text.structured_output import StructuredOutput

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
