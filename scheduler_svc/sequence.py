"""A sequence: one request's tokens and how far the KV cache has caught up with them.

Following vLLM v1, there is no prefill or decode phase: a sequence has `num_tokens` (prompt +
output) and `num_computed_tokens` (already in the KV cache); each step feeds some of the
difference. A prompt chunk, a recompute after preemption and a decode are the same thing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_tokens reached
    STOP = "stop"  # eos or a stop token id
    STOP_SEQUENCE = "stop_sequence"  # a stop string appeared in the text
    CONTEXT_LENGTH = "context_length"  # max_model_len reached
    ABORTED = "aborted"  # cancelled by the client or failed


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0  # always set: the engine draws one for unseeded requests


@dataclass(frozen=True)
class StoppingParams:
    max_tokens: int | None  # None: until another condition or the end of the context
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stopping: StoppingParams
    # Order of arrival; preemption picks the latest arrival as the victim.
    arrival: int
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

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
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
