"""A request's sequences, scheduled, preempted and swapped as one unit.

The sequences of a group share blocks (the prompt, and forks' common history), so moving
one without the others would duplicate memory; beams must also step together, since each
beam step ranks the candidates of every beam at once. Three shapes:

    plain        n = best_of = beam_width = 1: one sequence, streamed
    samples      best_of > 1: the prompt is computed once, then the group forks before its
                 last prompt token, so each sample draws its first token with its own seed
                 from its own logits row. All are streamed when n == best_of; otherwise the
                 n with the best cumulative logprob are returned at the end.
    beams        beam_width > 1: `beam_search.BeamSearch` forks and drops sequences each step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from scheduler_svc.sched.sequence import SamplingOptions, Sequence, SequenceStatus

if TYPE_CHECKING:
    from scheduler_svc.lora.adapter_registry import Adapter
    from scheduler_svc.sched.beam_search import BeamSearch


@dataclass(eq=False)
class SequenceGroup:
    request_id: str
    seqs: list[Sequence]  # every sequence ever in the group, finished ones included
    sampling: SamplingOptions
    arrival: int
    priority: int = 0  # lower is served first
    status: SequenceStatus = SequenceStatus.WAITING
    forked: bool = False  # samples: whether the fork at the last prompt token happened
    beam: BeamSearch | None = field(default=None, repr=False)
    # The LoRA adapter every sequence of the group runs through (None: the base model).
    adapter: Adapter | None = None
    # Accounting reported with the final response.
    num_preemptions: int = 0
    num_swaps: int = 0
    swapped_blocks: int = 0  # blocks moved either way
    prefix_hit_tokens: int = 0
    preempted_step: int = -1  # step in which it was last preempted
    # (token, logprob, top alternatives) of prompt tokens 1..P-1, filled by the first pass over
    # the prompt when sampling.prompt_logprobs is set.
    prompt_logprobs: list[tuple[int, float, tuple[tuple[int, float], ...]]] = field(default_factory=list)
    group_id: int = field(init=False)
    width: int = field(init=False)

    def __post_init__(self) -> None:
        # The first sequence's id names the group for good, even after beams drop it.
        self.group_id = self.seqs[0].seq_id
        # Sequences the group runs at its widest (its slots against max_num_seqs). Read for
        # every row of every step: a plain attribute, not a computed property.
        self.width = max(self.sampling.best_of, self.sampling.beam_width)
        for seq in self.seqs:
            seq.group_id = self.group_id

    @classmethod
    def of(cls, seq: Sequence, priority: int = 0) -> SequenceGroup:
        """The group of a request that starts as one sequence."""
        return cls(seq.request_id, [seq], seq.sampling, seq.arrival, priority=priority)

    @property
    def key(self) -> tuple[int, int]:
        """Place in line: priority first, then arrival. Preemption never changes it."""
        return (self.priority, self.arrival)

    @property
    def cache_salt(self) -> int:
        """Where the group's prefix-cache hash chains start: 0 for the base model."""
        return self.adapter.cache_salt if self.adapter is not None else 0

    def shared_prompt_blocks(self, block_size: int) -> int:
        """Full blocks of the prompt that every sequence of the group holds in common."""
        return shared_prompt_blocks(len(self.seqs[0].prompt_token_ids), block_size)

    @property
    def is_beam(self) -> bool:
        return self.sampling.beam_width > 1

    @property
    def needs_fork(self) -> bool:
        return self.sampling.best_of > 1 and not self.forked

    @property
    def streams(self) -> bool:
        """Whether tokens go to the client as they come (else: the chosen outputs at the end)."""
        return not self.is_beam and self.sampling.best_of == self.sampling.n

    def live(self) -> list[Sequence]:
        return [s for s in self.seqs if s.status is not SequenceStatus.FINISHED]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def best(self) -> list[Sequence]:
        """The n sequences returned: by cumulative logprob when best_of > n, else all in order."""
        if self.sampling.best_of == self.sampling.n:
            return list(self.seqs)
        ranked = sorted(self.seqs, key=lambda s: (-s.cumulative_logprob, s.index))
        return ranked[: self.sampling.n]


def shared_prompt_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Full blocks of a prompt that a group's sequences share: every block before the one with
    the last prompt token, which each sample (forked before that token) writes for itself."""
    return (num_prompt_tokens - 1) // block_size
