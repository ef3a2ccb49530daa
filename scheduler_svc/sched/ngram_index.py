"""Prompt lookup: the draft tokens an n-gram of a sequence's own tokens proposes.

Text that repeats itself (a rewritten passage, quoted code, JSON keys) continues the way it
did last time: when the sequence's last n tokens occurred earlier, the tokens that followed
them then are a good guess for the next ones. The index maps every n-gram (n from min_n to
max_n) to where its latest earlier occurrence ended, extended as tokens arrive, so a lookup
costs max_n - min_n + 1 dict probes and each new token max_n - min_n + 1 insertions, however
long the sequence (vLLM's proposer scans the whole context every step instead).

Only the last `window` tokens of a long prompt are indexed at first: what a million-token
prompt repeats from far back is rarely what comes next, and the index would cost its memory.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    def __init__(self, min_n: int, max_n: int, window: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {min_n}, {max_n}")
        self.min_n, self.max_n, self.window = min_n, max_n, window
        self._ends: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in the index

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """`k` tokens that followed the latest earlier occurrence of the longest suffix of
        `tokens` (at least min_n long) that occurred before; [] when none did. An occurrence
        fewer than k tokens back is a loop of that period: the draft goes round it again
        (the latest occurrence has fewer tokens after it than an earlier one, but the same)."""
        total = len(tokens)
        # An n-gram ending at e is indexed once a token follows it (e < total): the suffix
        # itself (ending at total) never matches its own occurrence.
        self._extend(tokens, total - 1)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            end = self._ends.get(tuple(tokens[total - n : total]))
            if end is not None:
                out = list(tokens[end : min(end + k, total)])
                period = total - end
                while len(out) < k:
                    out.append(out[len(out) - period])
                return out
        return []

    def _extend(self, tokens: Sequence[int], upto: int) -> None:
        start = max(self._indexed, upto - self.window, self.min_n)
        ends = self._ends
        for e in range(start, upto + 1):
            for n in range(self.min_n, min(self.max_n, e) + 1):
                ends[tuple(tokens[e - n : e])] = e
        self._indexed = max(self._indexed, upto + 1)
