"""What the drafter keeps of one sequence: its n-gram index (or the draft model's last
proposals) and how its drafts have done."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_svc.sched.ngram_index import NgramIndex
from scheduler_svc.sched.suffix_index import SuffixIndex


@dataclass
class DraftState:
    index: NgramIndex | SuffixIndex | None  # None: a draft model proposes
    drafted: int = 0
    accepted: int = 0
    recent_drafted: int = 0
    recent_accepted: int = 0
    rest_until: int = 0  # no drafts until the sequence holds this many tokens
    failed_reviews: int = 0  # reviews in a row that found the drafts failing (each rest is longer)
    last_kept: int = -1  # the sequence's length when a step last kept drafts of it (-1: never)
    # The draft model's proposals, good while the sequence holds proposed_at tokens (they
    # continue its last one).
    proposed: list[int] = field(default_factory=list)
    proposed_at: int = -1
