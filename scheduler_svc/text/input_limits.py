"""Size checks of a client's text before any tokenizer, template or grammar compiler sees it.

Each bound is a field of `common.request_limits.RequestLimits` with a scheduler flag of the same name
(`max_prompt_bytes` is `--max-prompt-bytes`); a refusal names both, so whoever reads it knows
what was too big and how an operator would allow it. The checks cost O(1) or one pass over the
text in C (`str.encode`), never a Python loop over characters: they run on the event loop.
"""

from __future__ import annotations

from collections.abc import Iterable

from common.errors import InvalidArgument
from common.request_limits import RequestLimits

# The bounds a caller gets without naming any (those of the flags' defaults).
DEFAULT_LIMITS = RequestLimits()


def flag_of(name: str) -> str:
    """The scheduler flag that sets RequestLimits field `name`."""
    return "--" + name.replace("_", "-")


def over_limit(field: str, got: int | str, unit: str, name: str, limit: int) -> InvalidArgument:
    """INVALID_ARGUMENT for `field` beyond RequestLimits `name` (whose value is `limit`)."""
    return InvalidArgument(field, f"{got} {unit} exceed {name} ({limit}); the scheduler's {flag_of(name)} raises it")


def utf8_size(text: str) -> int:
    """`text`'s size in UTF-8 bytes: its length when it is ASCII (known without a pass over
    it), else one pass in C over a text the gRPC message size already bounds."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def check_text_bytes(field: str, texts: Iterable[str], limits: RequestLimits, name: str) -> None:
    """The texts together within RequestLimits `name` (a size in UTF-8 bytes)."""
    limit: int = getattr(limits, name)
    total = 0
    for text in texts:
        total += utf8_size(text)
        if total > limit:
            raise over_limit(field, total, "bytes", name, limit)


def check_messages_bytes(messages: Iterable[tuple[str, str]], limits: RequestLimits, name: str) -> None:
    """A conversation's roles and contents together within RequestLimits `name` (bytes)."""
    check_text_bytes("messages", (part for message in messages for part in message), limits, name)


def check_count(field: str, count: int, unit: str, limits: RequestLimits, name: str) -> None:
    """A number of items within RequestLimits `name`."""
    limit: int = getattr(limits, name)
    if count > limit:
        raise over_limit(field, count, unit, name, limit)
