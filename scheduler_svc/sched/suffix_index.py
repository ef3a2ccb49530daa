"""Suffix drafting: continuations counted over a sequence's own tokens and, shared across
requests, over earlier requests' outputs (the idea of suffix decoding).

Where prompt lookup (ngram_index.py) copies what followed the latest occurrence of the
suffix, this keeps, for every context of 1..max_n tokens, how often each token followed it,
and drafts by walking the most frequent continuation: from the longest context seen, the
likeliest next token, then the likeliest after that, while the walk stays confident (the
token's share of what followed its context at least `min_share`). Counting makes it fit
output that repeats with variations (JSON records, code, templated answers), and the shared
index lets request n draft from requests 1..n-1 (an agent's repeated tool calls, a batch of
similar documents).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence


class SuffixIndex:
    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        self._next: dict[tuple[int, ...], Counter[int]] = {}
        self._indexed = 0  # tokens of the current stream counted so far
        self.size = 0  # (context, token) counts held, for a caller's bound

    def extend(self, tokens: Sequence[int], start: int = 0) -> None:
        """Count the continuations of tokens[start:] (each after its up to max_n predecessors
        within tokens)."""
        table = self._next
        for e in range(max(start, 1), len(tokens)):
            token = tokens[e]
            for n in range(1, min(self.max_n, e) + 1):
                table.setdefault(tuple(tokens[e - n : e]), Counter())[token] += 1
                self.size += 1

    def follow(self, tokens: Sequence[int], window: int) -> None:
        """Keep counting one growing stream (a sequence's own tokens) from where it left off;
        at first only its last `window` tokens (a long prompt's far past costs memory and
        rarely predicts what comes next)."""
        self.extend(tokens, max(self._indexed, len(tokens) - window))
        self._indexed = len(tokens)

    def best(self, context: Sequence[int]) -> tuple[int, int, float] | None:
        """(context length matched, token, its share) for the longest context of `context`'s
        suffix this index has seen; None if none."""
        for n in range(min(self.max_n, len(context)), 0, -1):
            counts = self._next.get(tuple(context[len(context) - n :]))
            if counts:
                token, count = counts.most_common(1)[0]
                return n, token, count / sum(counts.values())
        return None

    def clear(self) -> None:
        self._next.clear()
        self._indexed = self.size = 0


def draft(indexes: Sequence[SuffixIndex], tokens: Sequence[int], k: int, min_share: float) -> list[int]:
    """Up to `k` tokens walked from the suffix of `tokens`, each step taking the longest
    context match among `indexes` (ties: the first index, the sequence's own)."""
    out: list[int] = []
    context = list(tokens[-max(i.max_n for i in indexes) :])
    while len(out) < k:
        found = [b for b in (i.best(context) for i in indexes) if b is not None]
        if not found:
            break
        n, token, share = max(found, key=lambda b: b[0])
        if share < min_share:
            break
        out.append(token)
        context.append(token)
    return out
