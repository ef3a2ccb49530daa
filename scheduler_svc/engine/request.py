"""A generation request as the engine sees it, its validation, and what it streams back.

Validation happens here, once, before anything is queued: a bad request is refused with an
INVALID_ARGUMENT naming the field, a request that could never fit the KV pool with
RESOURCE_EXHAUSTED (docs/design.md section 2).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from common.config import SchedulerConfig
from common.errors import InvalidArgument, PermissionDenied, Unimplemented
from common.model_spec import ModelSpec
from common.request_limits import RequestLimits
from scheduler_svc.lora.adapter_registry import MAX_NAME_LENGTH
from scheduler_svc.sched.sequence import FinishReason, SamplingOptions, StoppingParams
from scheduler_svc.text.input_limits import check_count, check_messages_bytes, check_text_bytes, over_limit
from scheduler_svc.text.structured_output import StructuredOutput


@dataclass(frozen=True)
class GenerationRequest:
    """Fields of a GenerateRequest, as given by the client (not yet validated)."""

    request_id: str
    prompt: str = ""
    prompt_token_ids: tuple[int, ...] = ()
    temperature: float = 0.0
    top_p: float = 0.0  # 0 = unset = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 0  # 0 = until another condition or the end of the context
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 0  # 0 = 1
    best_of: int = 0  # 0 = n
    beam_width: int = 0  # 0 or 1 = no beam search
    length_penalty: float | None = None
    priority: int = 0
    messages: tuple[tuple[str, str], ...] = ()  # (role, content)
    min_p: float = 0.0
    repetition_penalty: float = 0.0  # 0 = unset = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # in the text stop strings are matched against
    structured_output: StructuredOutput | None = None
    adapter_id: str = ""  # a LoRA adapter's name; empty = the base model
    # Who sent it (common/grpc/auth.py Caller.name): Abort from another caller leaves it alone.
    owner: str = ""
    # The caller may jump the queue (priority below 0): an admin key, the gateway, in-process use.
    privileged: bool = False


@dataclass(frozen=True)
class RequestStats:
    """How a request was served, reported with its final messages."""

    prefix_cache_hit_tokens: int = 0
    num_preemptions: int = 0
    num_swaps: int = 0
    swapped_bytes: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability and the most likely (token, logprob) pairs at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RequestOutput:
    """One streamed piece of a generation (of output `index`)."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    index: int = 0
    cumulative_logprob: float = 0.0
    stats: RequestStats | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token_ids entry, when asked for
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # every prompt token after the first, first message only
    stop_sequence: str = ""  # the stop string that matched (STOP_SEQUENCE)
    stop_token_id: int | None = None  # the token that ended the output (STOP)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache so far

    def followed_by(self, later: RequestOutput) -> RequestOutput:
        """This piece and the next of the same output as one (the later one's totals)."""
        return dataclasses.replace(
            later,
            token_ids=self.token_ids + later.token_ids,
            text=self.text + later.text,
            logprobs=self.logprobs + later.logprobs,
            prompt_logprobs=self.prompt_logprobs + later.prompt_logprobs,
        )


@dataclass(frozen=True)
class Limits:
    """What the served model and this deployment allow."""

    vocab_size: int
    max_model_len: int
    max_prompt_tokens: int = 0  # 0 = up to the context
    max_stop_strings: int = 16
    max_logprobs: int = 20
    max_n: int = 16  # most outputs, candidates (best_of) or beams of one request
    # Sizes no request may pass (prompt bytes, stop strings, grammars...), each with its flag.
    request: RequestLimits = RequestLimits()

    @classmethod
    def of(cls, spec: ModelSpec, config: SchedulerConfig, max_model_len: int | None = None) -> Limits:
        return cls(
            vocab_size=spec.vocab_size,
            max_model_len=max_model_len or spec.max_model_len,
            max_prompt_tokens=config.max_prompt_tokens,
            max_stop_strings=config.max_stop_strings,
            max_logprobs=config.max_logprobs,
            max_n=config.max_n,
            request=config.limits,
        )


MAX_REQUEST_ID_LENGTH = 256


def check_request_id(request_id: str) -> None:
    """A request id is echoed as gRPC metadata (x-request-id) and logged: printable ASCII only,
    as metadata values must be, and short."""
    if len(request_id) > MAX_REQUEST_ID_LENGTH:
        raise InvalidArgument("request_id", f"at most {MAX_REQUEST_ID_LENGTH} characters, got {len(request_id)}")
    bad = next((c for c in request_id if not " " <= c <= "~"), None)
    if bad is not None:
        raise InvalidArgument("request_id", f"printable ASCII only (gRPC metadata), got {bad!r}")


def check_privilege(req: GenerationRequest) -> None:
    """What only privileged callers may ask for: a place ahead of everyone else's requests."""
    if req.priority < 0 and not req.privileged:
        raise PermissionDenied(f"priority: below 0 needs an admin API key, got {req.priority}")


def check_fields(req: GenerationRequest, limits: Limits) -> None:
    """Checks that need no tokenizer; raises InvalidArgument naming the field. Sizes come
    before the loops over items, so no loop runs long on the event loop."""
    check_request_id(req.request_id)
    given = sum(map(bool, (req.prompt, req.prompt_token_ids, req.messages)))
    if given > 1:
        raise InvalidArgument("prompt", "set exactly one of prompt, prompt_token_ids and messages")
    if not given:
        raise InvalidArgument("prompt", "empty prompt: set prompt, prompt_token_ids or messages")
    check_prompt_size(req, limits)
    _check_token_ids("prompt_token_ids", req.prompt_token_ids, limits.vocab_size)
    if len(req.adapter_id) > MAX_NAME_LENGTH:
        raise InvalidArgument("adapter_id", f"at most {MAX_NAME_LENGTH} characters, got {len(req.adapter_id)}")
    if not math.isfinite(req.temperature) or req.temperature < 0:
        raise InvalidArgument("sampling.temperature", f"must be a finite number >= 0, got {req.temperature}")
    if math.isnan(req.top_p) or not 0 <= req.top_p <= 1:
        raise InvalidArgument("sampling.top_p", f"must lie in (0, 1] (0 means unset), got {req.top_p}")
    check_count("stopping.stop_token_ids", len(req.stop_token_ids), "ids", limits.request, "max_stop_token_ids")
    _check_token_ids("stopping.stop_token_ids", req.stop_token_ids, limits.vocab_size)
    if len(req.stop) > limits.max_stop_strings:
        raise InvalidArgument("stopping.stop", f"at most {limits.max_stop_strings} stop strings, got {len(req.stop)}")
    longest = limits.request.max_stop_string_length
    for i, stop in enumerate(req.stop):
        if not stop:
            raise InvalidArgument(f"stopping.stop[{i}]", "empty stop string")
        if len(stop) > longest:
            raise over_limit(f"stopping.stop[{i}]", len(stop), "characters", "max_stop_string_length", longest)
    _check_width(req, limits)
    _check_processing(req, limits)


def check_prompt_size(req: GenerationRequest, limits: Limits) -> None:
    """Before any tokenizer or template sees it: the prompt's text (or the conversation's)
    within --max-prompt-bytes, its token ids within the context."""
    check_text_bytes("prompt", (req.prompt,), limits.request, "max_prompt_bytes")
    check_messages_bytes(req.messages, limits.request, "max_prompt_bytes")
    if req.prompt_token_ids:
        check_length(len(req.prompt_token_ids), 0, limits)  # max_tokens comes after the rest


def _check_token_ids(field: str, token_ids: tuple[int, ...], vocab_size: int) -> None:
    """Every id inside the vocabulary; the scan is min and max, in C."""
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
        i, token = next((i, t) for i, t in enumerate(token_ids) if not 0 <= t < vocab_size)
        raise InvalidArgument(f"{field}[{i}]", f"token id {token} is outside the vocabulary (size {vocab_size})")


def _check_processing(req: GenerationRequest, limits: Limits) -> None:
    """Logits processing and logprobs: ranges as vLLM and OpenAI define them."""
    if math.isnan(req.min_p) or not 0 <= req.min_p <= 1:
        raise InvalidArgument("sampling.min_p", f"must lie in [0, 1], got {req.min_p}")
    if not math.isfinite(req.repetition_penalty) or req.repetition_penalty < 0:
        raise InvalidArgument(
            "sampling.repetition_penalty", f"must be > 0 (0 means unset), got {req.repetition_penalty}"
        )
    for name, value in (("presence_penalty", req.presence_penalty), ("frequency_penalty", req.frequency_penalty)):
        if math.isnan(value) or not -2 <= value <= 2:
            raise InvalidArgument(f"sampling.{name}", f"must lie in [-2, 2], got {value}")
    for name, k in (("logprobs", req.logprobs), ("prompt_logprobs", req.prompt_logprobs)):
        if k is not None and k > limits.max_logprobs:
            raise InvalidArgument(f"sampling.{name}", f"at most {limits.max_logprobs} alternatives, got {k}")
    if req.beam_width > 1 and req.logprobs is not None:
        raise Unimplemented("sampling.logprobs: log-probabilities with beam search are not supported yet")
    check_count("sampling.logit_bias", len(req.logit_bias), "entries", limits.request, "max_logit_bias")
    for token, bias in req.logit_bias:
        if not 0 <= token < limits.vocab_size:
            raise InvalidArgument(
                f"sampling.logit_bias[{token}]", f"token id outside the vocabulary (size {limits.vocab_size})"
            )
        if not math.isfinite(bias) or not -100 <= bias <= 100:
            raise InvalidArgument(f"sampling.logit_bias[{token}]", f"bias must lie in [-100, 100], got {bias}")
    if req.max_tokens and req.min_tokens > req.max_tokens:
        raise InvalidArgument("stopping.min_tokens", f"{req.min_tokens} exceeds max_tokens ({req.max_tokens})")
    so = req.structured_output
    if so is not None:
        so.check(limits.request)
        if req.beam_width > 1:
            raise Unimplemented(f"{so.field}: structured outputs with beam search are not supported")
        if req.min_tokens:
            # The grammar decides where the output may end; banning its stop token before then
            # could leave nothing it allows.
            raise InvalidArgument("stopping.min_tokens", f"cannot be combined with {so.field}")


def _check_width(req: GenerationRequest, limits: Limits) -> None:
    n = req.n or 1
    for name, value in (("sampling.n", n), ("sampling.best_of", req.best_of), ("sampling.beam_width", req.beam_width)):
        if value > limits.max_n:
            raise InvalidArgument(name, f"at most {limits.max_n}, got {value}")
    if req.best_of and req.best_of < n:
        raise InvalidArgument("sampling.best_of", f"must be >= n ({n}), got {req.best_of}")
    if req.length_penalty is not None and not math.isfinite(req.length_penalty):
        raise InvalidArgument("sampling.length_penalty", f"must be finite, got {req.length_penalty}")
    if req.beam_width > 1:
        if req.best_of > 1:
            raise InvalidArgument("sampling.best_of", "set either best_of or beam_width, not both")
        if n > req.beam_width:
            raise InvalidArgument("sampling.n", f"must be <= beam_width ({req.beam_width}), got {n}")
        if req.temperature > 0:
            raise InvalidArgument("sampling.temperature", "beam search is deterministic: set temperature to 0")
        if req.stop:
            raise Unimplemented("stopping.stop: stop strings with beam search are not supported yet")
        # Beams are ranked on the raw log-probabilities: logit processing would be ignored.
        for name, used in (
            ("sampling.repetition_penalty", req.repetition_penalty not in (0.0, 1.0)),
            ("sampling.presence_penalty", req.presence_penalty != 0),
            ("sampling.frequency_penalty", req.frequency_penalty != 0),
            ("sampling.logit_bias", bool(req.logit_bias)),
            ("stopping.min_tokens", req.min_tokens > 0),
        ):
            if used:
                raise Unimplemented(f"{name} with beam search is not supported yet")


def check_length(num_prompt_tokens: int, max_tokens: int, limits: Limits) -> None:
    """The prompt (and max_tokens when set) must fit the model's context."""
    if num_prompt_tokens == 0:
        raise InvalidArgument("prompt", "the prompt tokenizes to no tokens")
    if limits.max_prompt_tokens and num_prompt_tokens > limits.max_prompt_tokens:
        raise InvalidArgument(
            "prompt",
            f"{num_prompt_tokens} prompt tokens exceed this server's --max-prompt-tokens ({limits.max_prompt_tokens})",
        )
    if num_prompt_tokens >= limits.max_model_len:
        raise InvalidArgument(
            "prompt",
            f"{num_prompt_tokens} prompt tokens leave no room in the model's context of {limits.max_model_len} "
            "tokens; shorten the prompt, or raise --max-model-len up to what the model's positions allow",
        )
    if max_tokens and num_prompt_tokens + max_tokens > limits.max_model_len:
        raise InvalidArgument(
            "stopping.max_tokens",
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {num_prompt_tokens + max_tokens} "
            f"exceeds the model's context of {limits.max_model_len} tokens; lower max_tokens, or raise "
            "--max-model-len up to what the model's positions allow",
        )


# Below this a temperature would overflow the scaled logits; it samples the argmax anyway.
MIN_TEMPERATURE = 1e-5


def sampling_options(req: GenerationRequest, seed: int, limits: Limits) -> SamplingOptions:
    return SamplingOptions(
        temperature=float(req.temperature) if req.temperature >= MIN_TEMPERATURE else 0.0,
        top_p=float(req.top_p) if req.top_p > 0 else 1.0,
        # top_k beyond the vocabulary keeps everything; clamping keeps it inside int32 too.
        top_k=min(int(req.top_k), limits.vocab_size),
        seed=seed,
        n=req.n or 1,
        # Beams are chosen by the search, never sampled: no best_of fork for them.
        best_of=1 if req.beam_width > 1 else req.best_of or req.n or 1,
        beam_width=max(req.beam_width, 1),
        length_penalty=1.0 if req.length_penalty is None else float(req.length_penalty),
        min_p=float(req.min_p),
        repetition_penalty=float(req.repetition_penalty) or 1.0,
        presence_penalty=float(req.presence_penalty),
        frequency_penalty=float(req.frequency_penalty),
        logit_bias=tuple((int(t), float(b)) for t, b in req.logit_bias),
        logprobs=req.logprobs,
        prompt_logprobs=req.prompt_logprobs,
    )


def stopping_params(req: GenerationRequest) -> StoppingParams:
    return StoppingParams(
        max_tokens=req.max_tokens or None,
        stop=tuple(req.stop),
        stop_token_ids=frozenset(req.stop_token_ids),
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
    )
