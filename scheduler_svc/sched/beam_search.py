"""Beam search over a group's sequences, with the semantics of transformers' `generate`.

Each beam step every live beam returns its K most likely next tokens (W = beam width,
K = (1 + number of stop tokens) x W, at least 2W, as transformers takes).
Candidates are scored by raw cumulative logprob and ranked over all beams; then

  - a candidate that ends (eos, stop token, max_tokens, context) and ranks among the first W
    becomes a finished hypothesis scored  cumulative_logprob / generated_len ** length_penalty
    (generated_len counts the eos); the pool keeps the W best;
  - the first W candidates that do not end become the next beams. A parent chosen k times
    continues as itself once and forks k - 1 times (its blocks are shared, the partly filled
    last one copied on write); a parent not chosen is dropped;
  - the search stops at max_tokens, or once the pool is full and the best live beam, divided
    by the current length ** length_penalty, can no longer beat the worst hypothesis
    (transformers' early_stopping=False).

It starts from one beam (the prompt), which is what transformers' -1e9 initial scores for
the other beams amount to.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from scheduler_svc.sched.sequence import FinishReason, Sequence


@dataclass(frozen=True)
class Hypothesis:
    score: float  # length-penalised
    cumulative_logprob: float
    output_token_ids: tuple[int, ...]
    finish_reason: FinishReason


@dataclass(frozen=True)
class BeamChoice:
    """Next beams as (parent, token, cumulative logprob), best first; `done` ends the search."""

    beams: list[tuple[Sequence, int, float]]
    done: bool


@dataclass
class BeamSearch:
    width: int
    length_penalty: float
    pool: list[Hypothesis] = field(default_factory=list)

    def step(
        self,
        beams: list[Sequence],
        top_ids: np.ndarray,  # int32 [len(beams), K], best first
        top_logprobs: np.ndarray,  # float32 [len(beams), K]
        ends: list[FinishReason | None],  # per beam: why one more token would end it, besides eos
        eos: frozenset[int],
    ) -> BeamChoice:
        k = top_ids.shape[1]
        candidates = [
            (beam.cumulative_logprob + float(top_logprobs[b, r]), b, r)
            for b, beam in enumerate(beams)
            for r in range(k)
            if top_ids[b, r] >= 0
        ]
        # Ties break by beam, then by the worker's rank: deterministic, as a sort must be.
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        candidates = candidates[:k]
        chosen: list[tuple[Sequence, int, float]] = []
        for rank, (score, b, r) in enumerate(candidates):
            beam, token = beams[b], int(top_ids[b, r])
            reason = FinishReason.STOP if token in eos else ends[b]
            if reason is None:
                if len(chosen) < self.width:
                    chosen.append((beam, token, score))
            elif rank < self.width:
                generated = beam.num_output_tokens + 1
                self._add(
                    Hypothesis(score / generated**self.length_penalty, score, (*beam.output_token_ids, token), reason)
                )
        if not chosen:
            return BeamChoice([], True)
        done = False
        if len(self.pool) == self.width:
            best_live = chosen[0][2] / (chosen[0][0].num_output_tokens + 1) ** self.length_penalty
            done = not best_live > self.pool[-1].score
        return BeamChoice(chosen, done)

    def _add(self, hyp: Hypothesis) -> None:
        self.pool.append(hyp)
        # Stable: among equal scores the earlier hypothesis stays ahead, as in transformers.
        self.pool.sort(key=lambda h: -h.score)
        del self.pool[self.width :]
