"""`SamplingParams` of the offline API: vLLM's field names and defaults, checked on construction.

Every field maps onto the native `GenerateRequest` (protos/llmserve/v1/generation.proto) except
`truncate_prompt_tokens`, which `LLM` applies itself before the prompt is sent;
`structured_outputs` (vLLM's `StructuredOutputsParams`) is its `structured_output`. The ranges are
checked here, with a ValueError naming the field, so that a bad value fails before any request
of a batch is queued; the engine checks them again (and its deployment limits: most stop
strings, logprobs and outputs) when the request arrives.
"""

from __future__ import annotations

import json as jsonlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# The native API's seed is a uint64.
_SEED_LIMIT = 1 << 64
_SO = "StructuredOutputsParams"


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must be, as vLLM names it: exactly one of these is set. The engine
    compiles it with xgrammar; a schema, regex or grammar it cannot compile is a ValueError
    from `LLM.generate` with the compiler's reason."""

    json: str | Mapping[str, Any] | None = None  # a JSON schema, as a dict or as its JSON text
    regex: str | None = None
    choice: Sequence[str] | None = None  # the output is exactly one of these
    grammar: str | None = None  # an EBNF grammar (xgrammar's dialect, `root ::= ...`)
    json_object: bool | None = None  # True: any JSON object

    def __post_init__(self) -> None:
        kinds = self.kinds
        if len(kinds) != 1:
            raise ValueError(
                f"{_SO}: set exactly one of json, regex, choice, grammar, json_object; got {', '.join(kinds) or 'none'}"
            )
        where = kinds[0]
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = jsonlib.loads(self.json)
                except jsonlib.JSONDecodeError as error:
                    raise ValueError(f"{_SO}.{where}: not valid JSON: {error}") from error
                _check_so(isinstance(schema, (dict, bool)), where, "a JSON schema is an object (or true / false)")
            else:
                _check_so(isinstance(self.json, Mapping), where, f"want a dict or its JSON text, got {self.json!r}")
                try:
                    jsonlib.dumps(self.json)
                except (TypeError, ValueError) as error:
                    raise ValueError(f"{_SO}.{where}: not serializable as JSON: {error}") from error
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                _check_so(
                    isinstance(value, str) and value.strip() != "", where, f"must be a non-empty string, got {value!r}"
                )
        if self.choice is not None:
            # A string is a Sequence too, but as choices it would be its characters.
            _check_so(
                not isinstance(self.choice, str) and len(self.choice) > 0, where, "want a non-empty list of strings"
            )
            for i, c in enumerate(self.choice):
                _check_so(isinstance(c, str) and c != "", f"{where}[{i}]", f"must be a non-empty string, got {c!r}")

    @property
    def kinds(self) -> list[str]:
        """The fields set (json_object only when True)."""
        named = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        return named + (["json_object"] if self.json_object else [])

    @property
    def schema_text(self) -> str:
        """`json` as JSON text (a dict is serialized; a string is used as given)."""
        return self.json if isinstance(self.json, str) else jsonlib.dumps(self.json)


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # outputs returned per prompt
    best_of: int | None = None  # candidates generated, the n most likely returned; None = n
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = no limit
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None  # None: the LLM's seed stream if it has one, else drawn by the engine
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None = until eos, a stop condition or the end of the context
    min_tokens: int = 0
    logprobs: int | None = None  # alternatives returned with each generated token
    prompt_logprobs: int | None = None  # alternatives returned with each prompt token
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: Mapping[int, float] | None = None  # added to these tokens' logits
    truncate_prompt_tokens: int | None = None  # keep only the last k prompt tokens
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output (JSON schema, regex, ...)

    def __post_init__(self) -> None:
        _check(self.n >= 1, "n", f"must be at least 1, got {self.n}")
        if self.best_of is not None:
            _check(self.best_of >= self.n, "best_of", f"must be >= n ({self.n}), got {self.best_of}")
        _check(
            math.isfinite(self.temperature) and self.temperature >= 0,
            "temperature",
            f"must be >= 0, got {self.temperature}",
        )
        _check(0 < self.top_p <= 1, "top_p", f"must lie in (0, 1], got {self.top_p}")
        _check(self.top_k >= -1, "top_k", f"must be -1 or 0 (no limit) or positive, got {self.top_k}")
        _check(0 <= self.min_p <= 1, "min_p", f"must lie in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2 <= value <= 2, name, f"must lie in [-2, 2], got {value}")
        _check(
            math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            f"must be > 0, got {self.repetition_penalty}",
        )
        if self.seed is not None:
            _check(0 <= self.seed < _SEED_LIMIT, "seed", f"must lie in [0, 2**64), got {self.seed}")
        for i, stop in enumerate(self.stop_strings):
            _check(isinstance(stop, str) and stop != "", f"stop[{i}]", f"must be a non-empty string, got {stop!r}")
        for i, token in enumerate(self.stop_token_ids or ()):
            _check(isinstance(token, int) and token >= 0, f"stop_token_ids[{i}]", f"must be a token id, got {token!r}")
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or value >= 0, name, f"must be >= 0, got {value}")
        for token, bias in (self.logit_bias or {}).items():
            _check(isinstance(token, int) and token >= 0, "logit_bias", f"keys must be token ids, got {token!r}")
            _check(
                math.isfinite(bias) and -100 <= bias <= 100,
                f"logit_bias[{token}]",
                f"must lie in [-100, 100], got {bias}",
            )
        if self.truncate_prompt_tokens is not None:
            _check(
                self.truncate_prompt_tokens >= 1,
                "truncate_prompt_tokens",
                f"must be at least 1, got {self.truncate_prompt_tokens}",
            )
        if self.structured_outputs is not None:
            _check(
                isinstance(self.structured_outputs, StructuredOutputsParams),
                "structured_outputs",
                f"want StructuredOutputsParams, got {type(self.structured_outputs).__name__}",
            )
            # The grammar decides where the output may end (the engine refuses it too).
            _check(not self.min_tokens, "min_tokens", "cannot be combined with structured_outputs")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """`stop` as a tuple: vLLM takes one string or a list of them."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}: {message}")


def _check_so(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{_SO}.{name}: {message}")
