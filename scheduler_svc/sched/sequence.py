"""A sequence: one sample's tokens and how far the KV cache has caught up with them.

Following vLLM v1, there is no prefill or decode phase: a sequence has `num_tokens` (prompt +
output) and `num_computed_tokens` (already in the KV cache); each step feeds some of the
difference. A prompt chunk, a prefix-cache hit, a recompute after preemption and a decode are
the same thing. A request owns one or more sequences (a `SequenceGroup`): n samples, best_of
candidates or beams of one prompt.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from scheduler_svc.sched.draft_state import DraftState
    from scheduler_svc.text.grammar import Grammar

_U64 = (1 << 64) - 1
_EMPTY = np.zeros(0, np.int32)
_GOLDEN = 0x9E3779B97F4A7C15


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_tokens reached
    STOP = "stop"  # eos or a stop token id
    STOP_SEQUENCE = "stop_sequence"  # a stop string appeared in the text
    CONTEXT_LENGTH = "context_length"  # max_model_len reached
    ABORTED = "aborted"  # cancelled by the client, failed, or a beam that lost


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingOptions:
    """How a request's tokens are chosen, validated and complete (a seed always drawn): what the
    scheduler plans with, whatever API the request came through. The offline API's
    `llmserve.SamplingParams` (vLLM's fields) is mapped onto the native request, then here."""

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0  # always set: the engine draws one for unseeded requests
    n: int = 1  # outputs returned
    best_of: int = 1  # candidates generated (>= n); the n with the best cumulative logprob return
    beam_width: int = 1  # > 1: beam search instead of sampling
    length_penalty: float = 1.0  # beam score = cumulative logprob / generated_len ** length_penalty
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # alternatives returned with each token; None = no logprobs
    prompt_logprobs: int | None = None  # alternatives returned with each prompt token; None = none

    @property
    def penalized(self) -> bool:
        """Whether the worker needs the sequence's token history this step."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def sample_seed(self, index: int) -> int:
        """Seed of the index-th sample: distinct per sample, fixed by the request's seed."""
        return (self.seed + index * _GOLDEN) & _U64


@dataclass(frozen=True)
class StoppingParams:
    max_tokens: int | None  # None: until another condition or the end of the context
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    min_tokens: int = 0  # eos and stop tokens are banned (and stop strings unmatched) before
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # False: stop strings may match special tokens' text


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    stopping: StoppingParams
    # Order of arrival of the request; with the priority it fixes the place in line.
    arrival: int
    index: int = 0  # which output of its request this is
    seed: int | None = None  # None: the request's seed
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens a plan in flight will sample for this sequence, not known yet: the scheduler
    # planned the next step past them (Scheduler.schedule while a plan is in flight), and that
    # step feeds the first of them as a deferred input. 0 or 1.
    pending: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    cumulative_logprob: float = 0.0
    num_preemptions: int = 0
    # The group_id of the request's SequenceGroup (its first sequence's id), set when the group
    # is made; the scheduler's group index maps it back (a sequence holds no link to its group).
    group_id: int = -1
    # Set by the scheduler at admission so the per-step stop check is one set lookup and one
    # comparison: tokens that end the sequence, and the length at which it ends anyway.
    stop_ids: frozenset[int] = field(default=frozenset(), repr=False)
    token_limit: int = field(default=0, repr=False)
    # Tokens as an int32 buffer and how many of them are filled in: kept only for penalized
    # sequences, whose history every sampling step sends to the worker.
    token_buffer: tuple[np.ndarray, int] = field(default_factory=lambda: (_EMPTY, 0), repr=False)
    # A structured output's matcher, advanced with every token appended (None: unconstrained).
    # It lives here, not on a worker, so preemption and recovery elsewhere keep it.
    grammar: Grammar | None = field(default=None, repr=False)
    # Speculative decoding (scheduler_svc/sched/drafter.py): the draft tokens the step being
    # planned feeds after the last token (cleared when its result is applied), and the
    # drafter's record of this sequence; with a draft model, how many tokens the step being
    # planned asks it to propose after it (its blocks reach that far).
    draft: list[int] = field(default_factory=list, repr=False)
    propose: int = field(default=0, repr=False)
    draft_state: DraftState | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.seed is None:
            self.seed = self.sampling.seed

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    def end_reason(self, token: int | None = None, ahead: int = 0) -> FinishReason | None:
        """The stop and length rules, in one place: why `token`, just appended, ends this
        sequence; or, with token None and ahead=1, why one more token of any value would
        (beam search asks before it picks). Needs stop_ids and token_limit (set at admission)."""
        stopping = self.stopping
        if token is not None and token in self.stop_ids and self.num_output_tokens > stopping.min_tokens:
            return FinishReason.STOP
        if token is not None and self.grammar is not None and self.grammar.terminated:
            return FinishReason.STOP  # the grammar is complete (its stop token accepted)
        if stopping.max_tokens is not None and self.num_output_tokens + ahead >= stopping.max_tokens:
            return FinishReason.LENGTH
        if self.num_tokens + ahead >= self.token_limit:
            return FinishReason.CONTEXT_LENGTH
        return None

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def fork(self, seq_id: int, index: int, seed: int) -> Sequence:
        """A copy that continues on its own from the same tokens and cache state."""
        return Sequence(
            seq_id=seq_id,
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            sampling=self.sampling,
            stopping=self.stopping,
            arrival=self.arrival,
            index=index,
            seed=seed,
            token_ids=list(self.token_ids),
            num_computed_tokens=self.num_computed_tokens,
            status=self.status,
            cumulative_logprob=self.cumulative_logprob,
            group_id=self.group_id,
            stop_ids=self.stop_ids,
            token_limit=self.token_limit,
            grammar=self.grammar.fork() if self.grammar is not None else None,
        )
