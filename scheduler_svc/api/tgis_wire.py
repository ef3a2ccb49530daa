"""The TGIS API's protobuf edge (`fmaas.GenerationService`): the only module touching fmaas types.

Requests are checked against what llmserve supports and translated to our terms
(`TgisParams`, then a `GenerationRequest`); outputs are translated back. An option we cannot
honour is refused with UNIMPLEMENTED naming it, never ignored. Options TGIS documents as
not applicable (sampling parameters under GREEDY, token details without a token list) are
not applicable here either.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from common.errors import InvalidArgument, Unimplemented
from common.pb.fmaas import generation_pb2 as pb
from scheduler_svc.engine.request import GenerationRequest, RequestOutput, TokenLogprob
from scheduler_svc.sched.sequence import FinishReason
from scheduler_svc.text.structured_output import StructuredOutput

# TGIS: "max_new_tokens: Default (0) is currently 20".
DEFAULT_MAX_NEW_TOKENS = 20
# TGIS servers return a matched stop sequence unless configured otherwise
# (`--default-include-stop-seqs`, default true); a request may say either.
DEFAULT_INCLUDE_STOP_SEQUENCE = True
MAX_TOP_N_TOKENS = 10

_STOP_REASON = {
    None: pb.NOT_FINISHED,
    FinishReason.LENGTH: pb.MAX_TOKENS,
    FinishReason.STOP: pb.EOS_TOKEN,
    FinishReason.STOP_SEQUENCE: pb.STOP_SEQUENCE,
    FinishReason.CONTEXT_LENGTH: pb.TOKEN_LIMIT,
    FinishReason.ABORTED: pb.CANCELLED,
}


@dataclass(frozen=True)
class TgisParams:
    """A TGIS `Parameters` message, checked, with TGIS's defaults applied."""

    sample: bool = False  # method SAMPLE; GREEDY ignores the sampling fields
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0  # 0 = unset = 1.0, as in ours
    seed: int | None = None
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: int = 0
    time_limit: float | None = None  # seconds
    stop_sequences: tuple[str, ...] = ()
    include_stop_sequence: bool = DEFAULT_INCLUDE_STOP_SEQUENCE
    repetition_penalty: float = 0.0  # 0 = unset = 1.0, as in ours
    truncate_input_tokens: int = 0  # 0 = keep the whole prompt
    input_text: bool = False
    generated_tokens: bool = False
    input_tokens: bool = False
    token_logprobs: bool = False  # with returned tokens: each one's log-probability
    top_n_tokens: int = 0  # with returned tokens: the most likely alternatives at each
    structured_output: StructuredOutput | None = None  # decoding's guided constraint
    adapter_id: str = ""  # a LoRA adapter's name; empty = the base model

    @property
    def _alternatives(self) -> int | None:
        """Our logprobs count for the returned tokens (None: no details asked)."""
        return self.top_n_tokens if self.token_logprobs or self.top_n_tokens else None

    def generation_request(
        self, prompt_token_ids: list[int], max_model_len: int, seed: int | None
    ) -> GenerationRequest:
        """Our request for one prompt. `seed` is the one to use (drawn by the caller if unset).

        TGIS does not refuse max_new_tokens beyond the context: generation stops when the
        context is full, with TOKEN_LIMIT. Our max_tokens = 0 means exactly that
        (CONTEXT_LENGTH), so a limit the context cannot hold becomes 0.
        """
        fits = len(prompt_token_ids) + self.max_new_tokens <= max_model_len
        return GenerationRequest(
            request_id="",
            prompt_token_ids=tuple(prompt_token_ids),
            temperature=self.temperature if self.sample else 0.0,
            top_p=self.top_p if self.sample else 0.0,
            top_k=self.top_k if self.sample else 0,
            seed=seed,
            max_tokens=self.max_new_tokens if fits else 0,
            stop=self.stop_sequences,
            min_tokens=self.min_new_tokens,
            include_stop_str_in_output=self.include_stop_sequence,
            repetition_penalty=self.repetition_penalty,
            logprobs=self._alternatives if self.generated_tokens else None,
            prompt_logprobs=self._alternatives if self.input_tokens else None,
            structured_output=self.structured_output,
            adapter_id=self.adapter_id,
        )


@dataclass(frozen=True)
class TimeLimit:
    """The request's time_limit_millis ran out after `generated` tokens (it was aborted)."""

    generated: int


# ---- requests ----


def batched_request(msg: pb.BatchedGenerationRequest, max_requests: int) -> tuple[list[str], TgisParams]:
    """The batch's prompts and parameters. Its size is checked before anything is made per
    prompt: 4 MiB of one-character prompts would otherwise be ~800,000 tasks on the event loop."""
    if len(msg.requests) > max_requests:
        raise InvalidArgument(
            "requests",
            f"{len(msg.requests)} prompts in one batch exceed the {max_requests} this server queues per worker "
            "group (--max-queue-len)",
        )
    return [r.text for r in msg.requests], _with_adapter(msg, params(msg.params))


def single_request(msg: pb.SingleGenerationRequest) -> tuple[str, TgisParams]:
    return msg.request.text, _with_adapter(msg, params(msg.params))


def _with_adapter(msg: pb.BatchedGenerationRequest | pb.SingleGenerationRequest, p: TgisParams) -> TgisParams:
    """adapter_id names one of our LoRA adapters (NOT_FOUND when unknown, as in TGIS); a
    prompt-tuning prefix (prefix_id) has nothing to run on."""
    if msg.HasField("prefix_id") and msg.prefix_id:
        raise Unimplemented("prefix_id: prompt-tuning prefixes are not supported; LoRA adapters go in adapter_id")
    return dataclasses.replace(p, adapter_id=msg.adapter_id) if msg.HasField("adapter_id") else p


def params(msg: pb.Parameters) -> TgisParams:
    s, stop, resp = msg.sampling, msg.stopping, msg.response
    sample = msg.method == pb.SAMPLE
    if sample and s.typical_p not in (0.0, 1.0):
        raise Unimplemented("params.sampling.typical_p: typical sampling is not supported")
    _check_decoding(msg.decoding)
    guided = _structured_output(msg.decoding)
    # Token details apply only to a returned token list (TGIS ignores them otherwise).
    if (resp.generated_tokens or resp.input_tokens) and resp.token_ranks:
        raise Unimplemented("params.response.token_ranks: token ranks are not supported")
    if resp.top_n_tokens > MAX_TOP_N_TOKENS:
        raise InvalidArgument("params.response.top_n_tokens", f"at most {MAX_TOP_N_TOKENS}, got {resp.top_n_tokens}")
    if len(set(stop.stop_sequences)) != len(stop.stop_sequences):
        raise InvalidArgument("params.stopping.stop_sequences", "duplicate stop sequence")
    max_new = stop.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
    if stop.min_new_tokens > max_new:
        raise InvalidArgument(
            "params.stopping.min_new_tokens", f"{stop.min_new_tokens} exceeds max_new_tokens ({max_new})"
        )
    if guided is not None and stop.min_new_tokens:
        # The engine refuses it too, but under the native API's field name.
        raise InvalidArgument(
            "params.stopping.min_new_tokens",
            f"cannot be combined with params.decoding.{msg.decoding.WhichOneof('guided')}",
        )
    return TgisParams(
        sample=sample,
        # TGIS: temperature 0 means unset, i.e. 1.0.
        temperature=(s.temperature or 1.0) if sample else 0.0,
        top_k=s.top_k if sample else 0,
        top_p=s.top_p if sample else 0.0,
        seed=s.seed if sample and s.HasField("seed") else None,
        max_new_tokens=max_new,
        min_new_tokens=stop.min_new_tokens,
        time_limit=stop.time_limit_millis / 1000 if stop.time_limit_millis else None,
        stop_sequences=tuple(stop.stop_sequences),
        include_stop_sequence=stop.include_stop_sequence
        if stop.HasField("include_stop_sequence")
        else DEFAULT_INCLUDE_STOP_SEQUENCE,
        repetition_penalty=msg.decoding.repetition_penalty,
        truncate_input_tokens=msg.truncate_input_tokens,
        input_text=resp.input_text,
        generated_tokens=resp.generated_tokens,
        input_tokens=resp.input_tokens,
        token_logprobs=resp.token_logprobs,
        top_n_tokens=resp.top_n_tokens,
        structured_output=guided,
    )


def _check_decoding(d: pb.DecodingParameters) -> None:
    if not math.isfinite(d.repetition_penalty) or d.repetition_penalty < 0:
        raise InvalidArgument(
            "params.decoding.repetition_penalty", f"must be > 0 (0 means unset), got {d.repetition_penalty}"
        )
    if d.HasField("length_penalty"):
        raise Unimplemented("params.decoding.length_penalty: the exponential EOS boost is not supported")


def _structured_output(d: pb.DecodingParameters) -> StructuredOutput | None:
    """The guided constraint (None: free text, which format TEXT also asks for). The engine
    checks it against the server's limits before any prompt is tokenized (check_fields), and
    the compiler's reasons come when it compiles."""
    guided = d.WhichOneof("guided")
    if guided is None:
        return None
    if guided == "format":
        if d.format == pb.DecodingParameters.TEXT:
            return None
        if d.format != pb.DecodingParameters.JSON:
            raise InvalidArgument("params.decoding.format", f"unknown format {d.format}; TEXT or JSON")
        spec = StructuredOutput("json_object", field="params.decoding")
    elif guided == "choice":
        spec = StructuredOutput("choice", choices=tuple(d.choice.choices), field="params.decoding")
    else:  # json_schema, regex, grammar: our kinds by the same names
        spec = StructuredOutput(guided, getattr(d, guided), field="params.decoding")
    return spec


# ---- responses ----


def stop_reason(out: RequestOutput | TimeLimit) -> pb.StopReason:
    return pb.TIME_LIMIT if isinstance(out, TimeLimit) else _STOP_REASON[out.finish_reason]


def token_infos(
    p: TgisParams,
    texts: list[str],
    details: list[TokenLogprob | None],
    text_of: Callable[[int], str],
) -> list[pb.TokenInfo]:
    """TokenInfo of each returned token; `details[i]` is token i's log-probability entry (None
    for a prompt's first token, which has nothing before it: TGIS reports NaN there)."""
    infos = []
    padded = list(details) + [None] * (len(texts) - len(details))
    for text, detail in zip(texts, padded):
        info = pb.TokenInfo(text=text)
        if p.token_logprobs:
            info.logprob = detail.logprob if detail is not None else math.nan
        if p.top_n_tokens and detail is not None:
            info.top_tokens.extend(
                pb.TokenInfo.TopToken(text=text_of(t), logprob=v) for t, v in detail.top[: p.top_n_tokens]
            )
        infos.append(info)
    return infos


def generation_response(
    p: TgisParams,
    prompt: str,
    input_token_count: int,
    input_tokens: list[pb.TokenInfo],
    outputs: list[RequestOutput],
    end: RequestOutput | TimeLimit,
    output_tokens: list[pb.TokenInfo],
    seed: int | None,
) -> pb.GenerationResponse:
    """The whole result of one prompt (Generate): the outputs joined, `end` saying why it ended.

    `input_tokens` are the prompt tokens' texts (after truncation) and `output_tokens` the
    generated tokens' texts, given when the options ask for them.
    """
    text = "".join(o.text for o in outputs)
    return pb.GenerationResponse(
        input_token_count=input_token_count,
        generated_token_count=end.generated if isinstance(end, TimeLimit) else end.completion_tokens,
        text=prompt + text if p.input_text else text,
        stop_reason=stop_reason(end),
        stop_sequence=_stop_sequence(end),
        seed=seed or 0,
        tokens=output_tokens if p.generated_tokens else [],
        input_tokens=input_tokens if p.input_tokens else [],
    )


def stream_head(
    p: TgisParams, prompt: str, input_token_count: int, input_tokens: list[pb.TokenInfo], seed: int | None
) -> pb.GenerationResponse:
    """First GenerateStream message: the input's details, no generated text yet."""
    return pb.GenerationResponse(
        input_token_count=input_token_count,
        text=prompt if p.input_text else "",
        seed=seed or 0,
        input_tokens=input_tokens if p.input_tokens else [],
    )


def stream_message(
    p: TgisParams, out: RequestOutput | TimeLimit, output_tokens: list[pb.TokenInfo]
) -> pb.GenerationResponse:
    """A GenerateStream message for one engine output (its new tokens and text)."""
    if isinstance(out, TimeLimit):
        return pb.GenerationResponse(generated_token_count=out.generated, stop_reason=pb.TIME_LIMIT)
    return pb.GenerationResponse(
        generated_token_count=out.completion_tokens,
        text=out.text,
        stop_reason=stop_reason(out),
        stop_sequence=_stop_sequence(out),
        tokens=output_tokens if p.generated_tokens else [],
    )


def _stop_sequence(out: RequestOutput | TimeLimit) -> str:
    if isinstance(out, TimeLimit) or out.finish_reason is not FinishReason.STOP_SEQUENCE:
        return ""
    return out.stop_sequence


# ---- tokenize and model info ----


@dataclass(frozen=True)
class TokenizeCall:
    texts: list[str]
    return_tokens: bool
    return_offsets: bool
    truncate_input_tokens: int


def tokenize_request(msg: pb.BatchedTokenizeRequest) -> TokenizeCall:
    return TokenizeCall(
        [r.text for r in msg.requests], msg.return_tokens, msg.return_offsets, msg.truncate_input_tokens
    )


def tokenize_response(
    call: TokenizeCall, results: list[tuple[list[str], list[tuple[int, int]]]]
) -> pb.BatchedTokenizeResponse:
    """`results`: per text, its tokens and their character offsets (after truncation)."""
    return pb.BatchedTokenizeResponse(
        responses=[
            pb.TokenizeResponse(
                token_count=len(tokens),
                tokens=tokens if call.return_tokens else [],
                offsets=[pb.TokenizeResponse.Offset(start=a, end=b) for a, b in offsets] if call.return_offsets else [],
            )
            for tokens, offsets in results
        ]
    )


def model_info_response(max_model_len: int) -> pb.ModelInfoResponse:
    return pb.ModelInfoResponse(
        model_kind=pb.ModelInfoResponse.DECODER_ONLY,
        max_sequence_length=max_model_len,
        # A prompt takes at least one token of the context.
        max_new_tokens=max_model_len - 1,
    )
