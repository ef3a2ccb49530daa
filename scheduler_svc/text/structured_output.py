"""What a request constrains its output to: a JSON schema, any JSON object, a regex, one of
a list of choices, or an EBNF grammar.

Every API (native, TGIS, the gateway protocol, the offline LLM) reduces its own fields to one
StructuredOutput; `scheduler_svc.text.grammar` compiles it against the model's tokenizer, and each
constrained sequence then carries a matcher that the scheduler advances with every sampled
token (docs/design.md section 2: grammar state stays in the scheduler, the plan carries token
masks).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from common.errors import InvalidArgument
from common.request_limits import RequestLimits
from scheduler_svc.text.input_limits import DEFAULT_LIMITS, check_text_bytes, flag_of

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    kind: str  # one of KINDS
    text: str = ""  # the schema (JSON text), regex or EBNF grammar; empty for json_object and choice
    choices: tuple[str, ...] = ()  # kind "choice": the output is exactly one of these
    field: str = "structured_output"  # the API's name for it, in error messages

    def check(self, limits: RequestLimits = DEFAULT_LIMITS) -> None:
        """Refusals that need no compiler (the compiler's own reasons come at compile time):
        the text within max_grammar_bytes, a JSON schema within max_grammar_depth."""
        where = f"{self.field}.{self.kind}"
        if self.kind not in KINDS:
            raise InvalidArgument(self.field, f"unknown kind {self.kind!r}; one of {', '.join(KINDS)}")
        check_text_bytes(where, (self.text, *self.choices), limits, "max_grammar_bytes")
        if self.kind in ("json_schema", "regex", "grammar") and not self.text.strip():
            raise InvalidArgument(where, "empty")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.text)
            except json.JSONDecodeError as error:
                raise InvalidArgument(where, f"not valid JSON: {error}") from error
            except RecursionError:
                # Deeper than Python's parser goes (about a thousand levels), so far deeper
                # than any limit: xgrammar would take minutes over it.
                raise _too_deep(where, "hundreds of levels", limits) from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidArgument(where, "a JSON schema is an object (or true / false)")
            depth = json_depth(schema)
            if depth > limits.max_grammar_depth:
                raise _too_deep(where, f"{depth} levels", limits)
        if self.kind == "choice":
            if not self.choices:
                raise InvalidArgument(where, "no choices")
            empty = next((i for i, c in enumerate(self.choices) if not c), None)
            if empty is not None:
                raise InvalidArgument(f"{where}[{empty}]", "empty choice")

    @property
    def key(self) -> tuple[str, str, tuple[str, ...]]:
        """What the compiler compiles: the API's name is not part of it."""
        return (self.kind, self.text, self.choices)

    @property
    def digest(self) -> bytes:
        """A hash of `key`, which names the compiled grammar in the cache (the texts are up to
        max_grammar_bytes each: the cache keeps no copy of them)."""
        return hashlib.sha256(json.dumps(self.key, ensure_ascii=False).encode("utf-8", "surrogatepass")).digest()


def json_depth(value: Any) -> int:
    """How deeply a parsed JSON value nests objects and arrays (a scalar is 0, `{}` is 1),
    walked with a stack of its own: no depth a client sends can exhaust Python's."""
    depth = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        depth = max(depth, level)
        stack.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return depth


def _too_deep(where: str, depth: str, limits: RequestLimits) -> InvalidArgument:
    limit = limits.max_grammar_depth
    return InvalidArgument(
        where,
        f"objects and arrays nested {depth} deep exceed max_grammar_depth ({limit}); "
        f"the scheduler's {flag_of('max_grammar_depth')} raises it",
    )


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose language is exactly `choices` (each a JSON-escaped literal, which
    is also the EBNF literal syntax xgrammar reads)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
