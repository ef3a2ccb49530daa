"""Per-request bounds of the scheduler's API, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True)
class RequestLimits:
    """Bounds no request can break (INVALID_ARGUMENT naming the limit beyond them), so that one
    caller's input cannot stall the event loop or fill memory for everyone."""

    # Prompt text (or all chat messages together), in UTF-8 bytes, checked before tokenizing.
    max_prompt_bytes: int = 1 << 20
    # Tokenize's text in bytes, Detokenize's token count.
    max_tokenize_bytes: int = 1 << 20
    max_detokenize_tokens: int = 1 << 18
    # Each stop string's length in characters (their count is SchedulerConfig.max_stop_strings).
    max_stop_string_length: int = 256
    max_stop_token_ids: int = 64
    max_logit_bias: int = 1024
    # Structured outputs: the schema, regex or grammar text in bytes, a JSON schema's nesting
    # depth, the seconds one compile may take (then RESOURCE_EXHAUSTED), and the compiled
    # grammars kept for reuse, in bytes.
    max_grammar_bytes: int = 64 << 10
    max_grammar_depth: int = 32
    grammar_compile_timeout: float = 10.0
    grammar_cache_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        for name in (
            "max_prompt_bytes",
            "max_tokenize_bytes",
            "max_detokenize_tokens",
            "max_stop_string_length",
            "max_grammar_bytes",
            "max_grammar_depth",
            "grammar_cache_bytes",
        ):
            _require(getattr(self, name) >= 1, f"{name} must be at least 1")
        _require(self.max_stop_token_ids >= 0, "max_stop_token_ids must not be negative")
        _require(self.max_logit_bias >= 0, "max_logit_bias must not be negative")
        _require(self.grammar_compile_timeout > 0, "grammar_compile_timeout must be positive")
