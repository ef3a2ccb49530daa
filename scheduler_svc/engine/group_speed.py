"""How fast one worker group computes: tokens per second of step time, recent steps weighing most.

Groups under one scheduler need not be alike (another GPU model, a pipeline over slower
devices, a CPU group beside GPU ones), so the router weighs them by what each has measured,
not by what it was told. The rate is a ratio of two decayed sums,

    tokens  <- tokens  * w + step's tokens
    seconds <- seconds * w + step's round trip        w = exp(-round trip / HALF_LIFE_S * ln 2)

so a step counts by its length, idle time counts for nothing (a group nobody sends work to
keeps its last speed instead of looking slow), and a group that slowed down shows it within
a few half-lives of busy time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

HALF_LIFE_S = 5.0  # of busy time
MIN_STEPS = 4  # before a rate counts: the first steps of a group include its warm-up


@dataclass
class GroupSpeed:
    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    def observe(self, num_tokens: int, roundtrip_s: float) -> None:
        w = math.exp(-max(roundtrip_s, 0.0) / HALF_LIFE_S * math.log(2))
        self.tokens = self.tokens * w + num_tokens
        self.seconds = self.seconds * w + max(roundtrip_s, 0.0)
        self.steps += 1

    @property
    def known(self) -> bool:
        return self.steps >= MIN_STEPS and self.seconds > 0 and self.tokens > 0

    @property
    def tokens_per_second(self) -> float:
        """0 until MIN_STEPS steps were measured."""
        return self.tokens / self.seconds if self.known else 0.0
