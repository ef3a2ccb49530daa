"""The scheduler's side of speculative decoding: which sequences draft, how many tokens, and
how well their drafts have done.

Drafting happens while the step is planned, on the CPU the scheduler already spends there,
from tokens the scheduler already holds; the worker only verifies (worker_svc/sampling/
draft_verifier.py). With a draft model ("draft") the worker also proposes: a step asks it for
a sequence's next drafts (Sequence.propose, with blocks reserved that far), its result brings
them, and the next step verifies them. A sequence drafts only where verification keeps
outputs exactly as they would be: plain greedy or random sampling, or under a structured
output's grammar (drafts cut where it stops allowing them, each verified position masked as
its decode would be), no other logit processing (bias, penalties, min_tokens bans), no
alternatives (logprobs of the chosen tokens alone are fine) or prompt scores, one sequence in
its group.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.speculative_config import SpeculativeConfig
from scheduler_svc.sched.draft_state import DraftState
from scheduler_svc.sched.ngram_index import NgramIndex
from scheduler_svc.sched.sequence import Sequence
from scheduler_svc.sched.suffix_index import SuffixIndex, draft

# Drafts between two looks at a sequence's acceptance rate (a sampled sequence's sooner: at
# temperature > 0 a draft is kept with the probability the model gives it, so a failing run is
# plainer earlier, while greedy JSON has short runs of misses between its keys), and tokens it
# then rests for when the rate was too low (doubled for each such look in a row, at most
# this many times). A greedy sequence rests briefly: greedy text that strays from what it
# copies mostly comes back to it within a few tokens (a rewritten number, a skipped
# sentence), and a rejected draft costs only its rows in a step that runs anyway, while every
# kept one saves a step. A sampled one rests long: its n-gram matches are chance, and its
# drafts would keep the plans after them waiting (Scheduler._plan_ahead) for nothing.
_REVIEW_DRAFTS = 16
_REVIEW_DRAFTS_SAMPLED = 8
_REST_TOKENS = 8
_REST_TOKENS_SAMPLED = 64
_MAX_REST_DOUBLINGS = 4
# A sequence that had drafts kept within this many tokens keeps the steps after it waiting
# for each result (none planned ahead), so that it tries every step while its text repeats.
_PRODUCTIVE_TOKENS = 8
# How far back a prompt is indexed at first (scheduler_svc/sched/ngram_index.py).
_PROMPT_WINDOW = 8192
# Suffix drafting: a walk stops at a token that followed its context less often than this
# share, and the index of earlier requests' outputs starts over past this many counts.
_MIN_SHARE = 0.3
_SHARED_COUNTS = 4_000_000


@dataclass
class Drafter:
    config: SpeculativeConfig
    # Totals since start, for the metrics (llmserve:spec_decode_*_tokens_total).
    drafted_total: int = 0
    accepted_total: int = 0
    # "suffix": what earlier requests' outputs continued each context with.
    shared: SuffixIndex | None = None

    def __post_init__(self) -> None:
        if self.config.method == "suffix":
            self.shared = SuffixIndex(self.config.prompt_lookup_max)

    def propose(self, seq: Sequence, budget: int) -> list[int]:
        """Draft tokens for `seq`'s next step (it decodes one token), within `budget` tokens for
        the whole row and the tokens it may still produce; [] where it should not draft."""
        k = min(self.config.num_speculative_tokens, budget - 1, seq.token_limit - len(seq.token_ids) - 1)
        state = self._ready(seq) if k > 0 else None
        if state is None:
            return []
        if state.index is None:  # the draft model's, if they continue the sequence as it is now
            return state.proposed[:k] if state.proposed_at == len(seq.token_ids) else []
        return self._lookup(state, seq, k)

    def productive(self, seq: Sequence) -> bool:
        """Whether the next plan should wait for the result in flight to draft `seq` from it:
        it may draft now (eligible, not resting) and either had drafts kept within its last
        few tokens or, decoding greedily, its tokens so far already propose a draft (its text
        has begun to repeat itself). A sampled sequence's proposals do not count before one is
        kept: sampled text matches n-grams by chance, and waiting for them would cost every
        plan its overlap."""
        state = self._ready(seq)
        if state is None:
            return False
        n = len(seq.token_ids)
        if state.last_kept >= 0 and n - state.last_kept <= _PRODUCTIVE_TOKENS:
            return True
        # A draft model's proposals come only with the result that asked for them.
        greedy = seq.sampling.temperature == 0
        return greedy and state.index is not None and bool(self._lookup(state, seq, 1))

    def lookahead(self, seq: Sequence, end: int) -> int:
        """A draft model: how many tokens to ask it for after a step that feeds `seq` up to
        position `end` and samples (0: none), within the sequence's limit."""
        if self._ready(seq) is None:
            return 0
        return max(0, min(self.config.num_speculative_tokens, seq.token_limit - end - 1))

    def proposed(self, seq: Sequence, tokens: list[int]) -> None:
        """The draft model's proposals for `seq` after the step just applied."""
        state = self._state(seq)
        state.proposed, state.proposed_at = tokens, len(seq.token_ids)

    def _lookup(self, state: DraftState, seq: Sequence, k: int) -> list[int]:
        """Up to `k` tokens `seq`'s n-gram or suffix index proposes after its last token."""
        if isinstance(state.index, NgramIndex):
            return state.index.propose(seq.token_ids, k)
        assert state.index is not None and self.shared is not None
        state.index.follow(seq.token_ids, _PROMPT_WINDOW)
        return draft((state.index, self.shared), seq.token_ids, k, _MIN_SHARE)

    def _ready(self, seq: Sequence) -> DraftState | None:
        """`seq`'s drafting state where it may draft now (eligible, not resting), else None."""
        if not self._eligible(seq):
            return None
        state = self._state(seq)
        return state if len(seq.token_ids) >= state.rest_until else None

    def _state(self, seq: Sequence) -> DraftState:
        state = seq.draft_state
        if state is None:
            c = self.config
            index: NgramIndex | SuffixIndex | None = None
            if self.shared is not None:
                index = SuffixIndex(c.prompt_lookup_max)
            elif c.method == "ngram":
                index = NgramIndex(c.prompt_lookup_min, c.prompt_lookup_max, _PROMPT_WINDOW)
            state = seq.draft_state = DraftState(index)
        return state

    def finished(self, seq: Sequence) -> None:
        """Suffix drafting: count a finished sequence's output (after the end of its prompt)
        into the index later requests draft from."""
        shared = self.shared
        if shared is None or not seq.num_output_tokens:
            return
        if shared.size > _SHARED_COUNTS:
            shared.clear()
        lead = min(shared.max_n, seq.num_prompt_tokens)
        shared.extend(seq.token_ids[seq.num_prompt_tokens - lead :], lead)

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """A verified step: `accepted` of `drafted` tokens kept."""
        self.drafted_total += drafted
        self.accepted_total += accepted
        state = seq.draft_state
        if state is None:
            return
        state.drafted += drafted
        state.accepted += accepted
        if accepted:
            state.last_kept = len(seq.token_ids)
        state.recent_drafted += drafted
        state.recent_accepted += accepted
        sampled = seq.sampling.temperature > 0
        if state.recent_drafted >= (_REVIEW_DRAFTS_SAMPLED if sampled else _REVIEW_DRAFTS):
            if state.recent_accepted < self.config.min_acceptance_rate * state.recent_drafted:
                # Twice as long each time in a row: text that keeps defeating the drafts (a
                # sampled request that matches its prompt's n-grams by chance) costs a
                # verification of K + 1 rows a step while it drafts, and gains nothing.
                rest = _REST_TOKENS_SAMPLED if sampled else _REST_TOKENS
                state.rest_until = len(seq.token_ids) + (rest << min(state.failed_reviews, _MAX_REST_DOUBLINGS))
                state.failed_reviews += 1
            else:
                state.failed_reviews = 0
            state.recent_drafted = state.recent_accepted = 0

    def _eligible(self, seq: Sequence) -> bool:
        o = seq.sampling
        return (
            (seq.grammar is None or seq.grammar.failure is None)
            # Each kept draft's own log-probability comes back with it (draft_verifier), so
            # logprobs without alternatives (0) draft too.
            and not o.logprobs
            and o.prompt_logprobs is None
            and not o.penalized
            and not o.logit_bias
            and o.beam_width == 1
            and o.best_of == 1
            and seq.num_output_tokens >= seq.stopping.min_tokens
        )
