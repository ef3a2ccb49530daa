"""scheduler_svc/text/prompt_text.py: prompts and conversations to token ids within their byte limit."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.errors import InvalidArgument
from common.request_limits import RequestLimits
from scheduler_svc.text.chat_template import ChatTemplate
from scheduler_svc.text.prompt_text import prompt_tokens
from scheduler_svc.text.tokenizer import Tokenizer


async def test_a_conversation_is_held_to_its_limit_as_rendered_not_as_sent(smollm2_dir: Path) -> None:
    tokenizer, template = Tokenizer(str(smollm2_dir)), ChatTemplate.from_dir(str(smollm2_dir))
    limits = RequestLimits(max_prompt_bytes=4096)
    # 400 empty messages weigh 1,600 bytes of roles but render to several times the limit.
    empties = tuple(("user", "") for _ in range(400))
    with pytest.raises(InvalidArgument, match=r"messages: \d+ bytes exceed max_prompt_bytes \(4096\)"):
        await prompt_tokens(tokenizer, template, "m", "", empties, limits, "max_prompt_bytes")
    few = (("user", "Hello there"),)
    ids = await prompt_tokens(tokenizer, template, "m", "", few, limits, "max_prompt_bytes")
    assert ids == tokenizer.encode(template.render([("user", "Hello there")]), False)


async def test_text_over_the_limit_is_refused_before_tokenizing(smollm2_dir: Path) -> None:
    tokenizer = Tokenizer(str(smollm2_dir))
    limits = RequestLimits(max_tokenize_bytes=10)
    with pytest.raises(InvalidArgument, match="max_tokenize_bytes"):
        await prompt_tokens(tokenizer, None, "m", "x" * 11, (), limits, "max_tokenize_bytes")
    assert await prompt_tokens(tokenizer, None, "m", "x" * 10, (), limits, "max_tokenize_bytes")
    with pytest.raises(InvalidArgument, match="no chat template"):
        await prompt_tokens(tokenizer, None, "m", "", (("user", "hi"),), limits, "max_tokenize_bytes")
