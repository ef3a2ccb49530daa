"""One sequence's place in its grammar (`Grammar`, an xgrammar matcher) and the token masks a
step's matchers fill (`fill_masks`): packed bitmasks, int32 [rows, ceil(vocab / 32)], bit j of
word w allowing token 32 w + j, which the plan carries to the worker. A row verifying drafts
gets a mask for each position it samples at.

A step waits for its masks, so one grammar whose masks are slow would slow every sequence of
its worker group: a mask may take MASK_BUDGET_S (grammar.py refuses a grammar whose first mask
takes longer; `MaskFiller` ends one that grows slower as it goes).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from common.errors import ResourceExhausted

# Seconds one grammar's token mask may take in a step (a decode step of a small model on CPU
# takes 20-50 ms; a normal JSON schema's mask 0.01-1 ms).
MASK_BUDGET_S = 0.05


class Grammar:
    """One sequence's place in its grammar. Forks copy it; preemption and moving the sequence
    to another worker group keep it, since it lives with the sequence."""

    def __init__(self, matcher: Any, filler: MaskFiller, words: int) -> None:
        self._matcher = matcher
        self._filler = filler
        self.words = words  # of its masks: ceil(vocab_size / 32)
        # Why the sequence cannot go on (its masks grew too slow): its next token is refused.
        self.failure: ResourceExhausted | None = None

    def accept(self, token: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it, or failed."""
        return self.failure is None and bool(self._matcher.accept_token(token))

    def allowed_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar allows from here, short of one that
        would complete it (a draft past the end would be masked by nothing); the matcher is
        left where it was."""
        matcher, n = self._matcher, 0
        if self.failure is None:
            for token in tokens:
                if not matcher.accept_token(token):
                    break
                n += 1
                if matcher.is_terminated():
                    matcher.rollback(1)
                    n -= 1
                    break
            if n:
                matcher.rollback(n)
        return n

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: the sequence ends."""
        return bool(self._matcher.is_terminated())

    def fork(self) -> Grammar:
        return Grammar(self._matcher.fork(), self._filler, self.words)


class MaskFiller:
    """Fills a step's masks, and finds the grammars over the budget.

    Timing each row would cost twice the batch call (0.68 ms against 0.29 ms for 256 rows of
    a JSON schema) and give up xgrammar's threads where it has several, so the batch is timed. Over the budget, each row is filled
    again on its own (the matchers have not moved: the masks come out the same) and timed in
    CPU seconds of this thread, which a busy machine does not stretch as it does the wall
    clock; the rows over the budget fail. A batch over the budget with no row over it is load,
    not one grammar: the rows are timed again only once a batch takes twice as long."""

    def __init__(self, batch: Any) -> None:
        self._batch = batch
        self._quiet_below = MASK_BUDGET_S

    def fill(self, grammars: list[Grammar], masks: np.ndarray) -> None:
        start = time.perf_counter()
        self._batch.batch_fill_next_token_bitmask([g._matcher for g in grammars], masks)
        took = time.perf_counter() - start
        if took <= MASK_BUDGET_S:
            self._quiet_below = MASK_BUDGET_S
            return
        if took <= self._quiet_below:
            return
        slow = self._fail_slow(grammars, [self._fill_one(g, masks, i) for i, g in enumerate(grammars)])
        self._quiet_below = MASK_BUDGET_S if slow else 2 * took

    @staticmethod
    def _fail_slow(grammars: list[Grammar], seconds: list[float]) -> bool:
        """Fail the grammars whose mask took over the budget; whether there were any."""
        slow = False
        for grammar, took in zip(grammars, seconds, strict=True):
            if took > MASK_BUDGET_S:
                slow = True
                grammar.failure = ResourceExhausted(
                    f"structured_output: its token masks grew to {took * 1e3:.0f} ms a step, over the "
                    f"{MASK_BUDGET_S * 1e3:.0f} ms a step may spend on one"
                )
        return slow

    @staticmethod
    def _fill_one(grammar: Grammar, masks: np.ndarray, row: int) -> float:
        start = time.thread_time()
        grammar._matcher.fill_next_token_bitmask(masks, row)
        return time.thread_time() - start


def first_mask_rows(drafts: list[list[int]]) -> np.ndarray:
    """int32 [len(drafts)]: the first of each row's masks when a row with d drafts has d + 1
    of them, in order (fill_masks' layout, the plan's mask_rows)."""
    widths = np.array([len(d) + 1 for d in drafts], dtype=np.int32)
    return np.cumsum(widths, dtype=np.int32) - widths


def fill_masks(grammars: list[Grammar], drafts: list[list[int]] | None = None) -> np.ndarray:
    """int32 [len(grammars), words]: the tokens each grammar allows next (xgrammar's threads
    fill the rows in parallel). The grammars come from one compiler. A grammar whose mask
    took more than MASK_BUDGET_S gets its `failure`.

    With `drafts` (tokens each grammar allows in turn: Grammar.allowed_prefix), grammar i has
    len(drafts[i]) + 1 consecutive rows: what it allows next, then after each of its drafts,
    the masks of the positions verification samples at. The matchers end where they began."""
    if not grammars:
        return np.zeros((0, 0), np.int32)
    masks = np.full((len(grammars), grammars[0].words), -1, np.int32)
    grammars[0]._filler.fill(grammars, masks)
    if drafts is None or not any(drafts):
        return masks
    first = first_mask_rows(drafts)
    out = np.full((int(first[-1]) + len(drafts[-1]) + 1, masks.shape[1]), -1, np.int32)
    out[first] = masks
    for grammar, draft, row in zip(grammars, drafts, first.tolist(), strict=True):
        matcher = grammar._matcher
        for j, token in enumerate(draft):
            matcher.accept_token(token)
            matcher.fill_next_token_bitmask(out, row + 1 + j)
        if draft:
            matcher.rollback(len(draft))
    return out
