"""Speculative decoding: how the scheduler drafts tokens for the workers to verify."""

from __future__ import annotations

from dataclasses import dataclass

SPECULATIVE_METHODS = ("ngram", "suffix", "draft")
# vLLM's name for drafts from a smaller model, taken as ours.
METHOD_ALIASES = {"draft_model": "draft"}
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """`method` "ngram": prompt lookup (scheduler_svc/sched/ngram_index.py) over the request's
    own prompt and output; "suffix": the most frequent continuations over the request's own
    tokens and earlier requests' outputs (scheduler_svc/sched/suffix_index.py), contexts of up
    to prompt_lookup_max tokens; "draft": a smaller model of the same vocabulary, run by the
    workers beside the served one (`model`, its directory: the workers' --speculative-model),
    proposes them. Field names follow vLLM's `speculative_config`."""

    method: str = "ngram"
    # Draft tokens proposed per sequence and step (a sequence then feeds up to 1 + K tokens).
    num_speculative_tokens: int = 4
    # The longest and shortest suffix n-gram looked up in the earlier tokens.
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # A step with more running sequences than this drafts nothing: a batch that large is
    # bound by compute, where verifying rejected drafts costs more than accepted ones save.
    disable_by_batch_size: int = 32
    # A sequence whose drafts were accepted less than this share of the time (over its
    # recent drafts) stops drafting for a while, then tries again.
    min_acceptance_rate: float = 0.2
    # "draft": the draft model's directory, for the workers `up` and the offline LLM start;
    # None where the workers are started apart, each with its --speculative-model.
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must lie in [1, {MAX_SPECULATIVE_TOKENS}]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt lookup n-grams need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.model is not None and self.method != "draft":
            raise ValueError(f"a speculative model drafts with method 'draft', not {self.method!r}")
        if self.disable_by_batch_size < 1 or not 0 <= self.min_acceptance_rate < 1:
            raise ValueError("disable_by_batch_size must be at least 1 and min_acceptance_rate lie in [0, 1)")
