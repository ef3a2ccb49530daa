"""What `LLM.generate` returns, in vLLM's shape: a `RequestOutput` per prompt holding a
`CompletionOutput` per sample, built from the pieces the engine streamed for the request.

vLLM's conventions kept here: `finish_reason` is "stop", "length" or "abort"; `stop_reason` is
the matched stop string, the token id when one of `stop_token_ids` ended the output, and None
for an end-of-sequence token or any other reason; logprobs are one dict per token, token id ->
`Logprob`, holding the chosen token and the requested alternatives; `prompt_logprobs` starts
with None, because the first prompt token has no distribution to come from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from scheduler_svc.engine.request import RequestOutput as Piece
from scheduler_svc.engine.request import TokenLogprob
from scheduler_svc.sched.sequence import FinishReason

_FINISH = {
    FinishReason.LENGTH: "length",
    # vLLM reports a full context as "length" too: the output was cut, not completed.
    FinishReason.CONTEXT_LENGTH: "length",
    FinishReason.STOP: "stop",
    FinishReason.STOP_SEQUENCE: "stop",
    FinishReason.ABORTED: "abort",
}


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability (of the model's unmodified distribution) at a position."""

    logprob: float
    # 1-based place among the most likely tokens; None for a chosen token outside the
    # alternatives that were asked for (its exact rank is not computed).
    rank: int | None = None
    decoded_token: str | None = None


# One generated or prompt token's entry: the token itself and its alternatives.
PositionLogprobs = dict[int, Logprob]


@dataclass(frozen=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None  # None unless SamplingParams.logprobs was set
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None  # None for a prompt given as token ids
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


def request_output(
    request_id: str,
    prompt: str | None,
    prompt_token_ids: list[int],
    pieces: Sequence[Piece],
    *,
    stop_token_ids: frozenset[int],
    logprobs: bool,
    prompt_logprobs: bool,
    decode: Callable[[int], str],
) -> RequestOutput:
    """Fold a finished request's streamed pieces into one RequestOutput."""
    by_index: dict[int, list[Piece]] = {}
    for piece in pieces:
        by_index.setdefault(piece.index, []).append(piece)
    tokens = _TokenText(decode)
    outputs = [
        _completion(index, by_index[index], stop_token_ids, tokens if logprobs else None) for index in sorted(by_index)
    ]
    prompt_entries = next((p.prompt_logprobs for p in pieces if p.prompt_logprobs), ())
    return RequestOutput(
        request_id=request_id,
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,
        prompt_logprobs=[None, *(tokens.position(e) for e in prompt_entries)] if prompt_logprobs else None,
        outputs=outputs,
        finished=bool(outputs) and all(o.finished() for o in outputs),
        num_cached_tokens=max((p.cached_tokens for p in pieces), default=0),
    )


def _completion(
    index: int, pieces: list[Piece], stop_token_ids: frozenset[int], tokens: _TokenText | None
) -> CompletionOutput:
    last = pieces[-1]
    reason = last.finish_reason
    stop_reason: int | str | None = None
    if reason is FinishReason.STOP_SEQUENCE:
        stop_reason = last.stop_sequence
    elif reason is FinishReason.STOP and last.stop_token_id in stop_token_ids:
        stop_reason = last.stop_token_id
    return CompletionOutput(
        index=index,
        text="".join(p.text for p in pieces),
        token_ids=[t for p in pieces for t in p.token_ids],
        cumulative_logprob=last.cumulative_logprob,
        logprobs=None if tokens is None else [tokens.position(e) for p in pieces for e in p.logprobs],
        finish_reason=None if reason is None else _FINISH[reason],
        stop_reason=stop_reason,
    )


class _TokenText:
    """Decoded text of single tokens, each decoded once per request."""

    def __init__(self, decode: Callable[[int], str]) -> None:
        self._decode = decode
        self._seen: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._seen.get(token_id)
        if text is None:
            text = self._seen[token_id] = self._decode(token_id)
        return text

    def position(self, entry: TokenLogprob) -> PositionLogprobs:
        """The chosen token first, then the alternatives, best first (vLLM's order)."""
        ranks = {token: rank for rank, (token, _) in enumerate(entry.top, start=1)}
        out = {entry.token_id: Logprob(entry.logprob, ranks.get(entry.token_id), self.text(entry.token_id))}
        for token, logprob in entry.top:
            if token not in out:
                out[token] = Logprob(logprob, ranks[token], self.text(token))
        return out
