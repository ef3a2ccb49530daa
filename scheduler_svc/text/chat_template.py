"""The model's chat template, rendered without transformers (the scheduler imports no torch).

Hugging Face models ship a Jinja template, in `chat_template.jinja` (transformers 5) or as
`chat_template` in tokenizer_config.json (older). It is rendered the way transformers renders
it: a sandboxed Jinja environment with trim_blocks and lstrip_blocks, `raise_exception`, the
tokenizer's special tokens as variables, and the generation prompt added. The rendered text
already holds every special token, so it is tokenized without adding more.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from common.errors import InvalidArgument

# A conversation: (role, content) pairs.
Messages = tuple[tuple[str, str], ...]


def _raise(message: str) -> None:
    raise TemplateError(message)


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(source)
        self._special = special_tokens

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The model's template, or None if it has none."""
        root = Path(model_dir)
        config: dict[str, Any] = {}
        if (root / "tokenizer_config.json").is_file():
            config = json.loads((root / "tokenizer_config.json").read_text())
        source: Any = None
        if (root / "chat_template.jinja").is_file():
            source = (root / "chat_template.jinja").read_text()
        else:
            source = config.get("chat_template")
            if isinstance(source, list):  # named templates: the default one
                source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if not isinstance(source, str):
            return None
        # Older configs write special tokens as AddedToken dicts ({"content": "<s>", ...}).
        special = {
            k: v if isinstance(v, str) else v["content"]
            for k, v in config.items()
            if k.endswith("_token")
            and (isinstance(v, str) or (isinstance(v, dict) and isinstance(v.get("content"), str)))
        }
        return cls(source, special)

    def render(self, messages: list[tuple[str, str]]) -> str:
        if not messages:
            raise InvalidArgument("messages", "empty conversation")
        for i, (role, _) in enumerate(messages):
            if not role:
                raise InvalidArgument(f"messages[{i}].role", "empty role")
        try:
            return self._template.render(
                messages=[{"role": r, "content": c} for r, c in messages],
                add_generation_prompt=True,
                **self._special,
            )
        except TemplateError as error:
            # The model's template refused the conversation (e.g. roles out of order).
            raise InvalidArgument("messages", f"the model's chat template refused it: {error}") from error
