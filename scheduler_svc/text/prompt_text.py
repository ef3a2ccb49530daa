"""A prompt's token ids from text or a conversation, within a byte limit, off the event loop.

Every size is checked before the tokenizer or the chat template sees the text, and the
template's output once more: the template adds text per message, so a conversation of many
empty messages renders to far more than it weighs.
"""

from __future__ import annotations

import asyncio

from common.errors import InvalidArgument
from common.request_limits import RequestLimits
from scheduler_svc.text.chat_template import ChatTemplate, Messages
from scheduler_svc.text.input_limits import check_messages_bytes, check_text_bytes
from scheduler_svc.text.tokenizer import Tokenizer


async def prompt_tokens(
    tokenizer: Tokenizer,
    template: ChatTemplate | None,
    model_name: str,
    text: str,
    messages: Messages,
    limits: RequestLimits,
    limit: str,
) -> list[int]:
    """The token ids of `text`, or of `messages` rendered by `template`, within RequestLimits `limit`."""
    if not messages:
        check_text_bytes("prompt", (text,), limits, limit)
        return await tokenizer.encode_off_loop(text)
    check_messages_bytes(messages, limits, limit)
    if template is None:
        raise InvalidArgument("messages", f"model {model_name!r} has no chat template; send a prompt")

    def render_and_encode() -> list[int]:
        rendered = template.render(list(messages))
        check_text_bytes("messages", (rendered,), limits, limit)
        return tokenizer.encode(rendered, False)  # the rendered text holds its special tokens

    return await asyncio.to_thread(render_and_encode)
