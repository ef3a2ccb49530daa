"""What a request constrains its output to: a JSON schema, any JSON object, a regex, one of
a list of choices, or an EBNF grammar.

Every API (native, TGIS, the gateway protocol, the offline LLM) reduces its own fields to one
StructuredOutput; `scheduler_svc.text.grammar` compiles it against the model's tokenizer, and each
constrained sequence then carries a matcher that the scheduler advances with every sampled
token (docs/design.md section 2: grammar state stays in the scheduler, the plan carries token
masks).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from common.errors import InvalidArgument

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    kind: str  # one of KINDS
    text: str = ""  # the schema (JSON text), regex or EBNF grammar; empty for json_object and choice
    choices: tuple[str, ...] = ()  # kind "choice": the output is exactly one of these
    field: str = "structured_output"  # the API's name for it, in error messages

    def check(self) -> None:
        """Refusals that need no compiler (the compiler's own reasons come at compile time)."""
        where = f"{self.field}.{self.kind}"
        if self.kind not in KINDS:
            raise InvalidArgument(self.field, f"unknown kind {self.kind!r}; one of {', '.join(KINDS)}")
        if self.kind in ("json_schema", "regex", "grammar") and not self.text.strip():
            raise InvalidArgument(where, "empty")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.text)
            except json.JSONDecodeError as error:
                raise InvalidArgument(where, f"not valid JSON: {error}") from error
            if not isinstance(schema, (dict, bool)):
                raise InvalidArgument(where, "a JSON schema is an object (or true / false)")
        if self.kind == "choice":
            if not self.choices:
                raise InvalidArgument(where, "no choices")
            empty = next((i for i, c in enumerate(self.choices) if not c), None)
            if empty is not None:
                raise InvalidArgument(f"{where}[{empty}]", "empty choice")

    @property
    def key(self) -> tuple[str, str, tuple[str, ...]]:
        """What identifies the compiled grammar (the cache key): the API's name is not part of it."""
        return (self.kind, self.text, self.choices)


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose language is exactly `choices` (each a JSON-escaped literal, which
    is also the EBNF literal syntax xgrammar reads)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
