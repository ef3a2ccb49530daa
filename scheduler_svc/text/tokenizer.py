"""The model's tokenizer, through the `tokenizers` library (transformers would pull torch in).

`tokenizers` keeps the GIL through `encode` and `decode` (a megabyte of text holds it for half
a second) but lets it go in `encode_batch` and `decode_batch`: encoding always goes through
the batch form, and the `*_off_loop` methods run it in a thread, so that the event loop and
the other handlers carry on meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Encoding
from tokenizers import Tokenizer as HfTokenizer

from common.errors import InvalidArgument
from common.request_limits import RequestLimits
from scheduler_svc.text.input_limits import check_count, check_text_bytes


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} has no tokenizer.json (a fast tokenizer is required)")
        self.backend = HfTokenizer.from_file(str(path))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with special tokens added the way transformers' tokenizer adds them."""
        return list(self.encodings([text], add_special_tokens)[0].ids)

    def encodings(self, texts: list[str], add_special_tokens: bool = True) -> list[Encoding]:
        """Each text's encoding (ids, token strings, offsets)."""
        return list(self.backend.encode_batch(texts, add_special_tokens=add_special_tokens))

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """The tokenizer's own string for each id (e.g. "Ġhello"), "" for an unknown id."""
        return [self.backend.id_to_token(t) or "" for t in token_ids]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Holds the GIL throughout: for the few tokens the detokenizer decodes per step (where
        `decode_batch` costs three times as much); long lists go through `decode_off_loop`."""
        return str(self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens))

    async def encode_off_loop(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`encode` in a thread: for texts the event loop should not wait on (prompts)."""
        return await asyncio.to_thread(self.encode, text, add_special_tokens)

    async def encodings_off_loop(self, texts: list[str], add_special_tokens: bool = True) -> list[Encoding]:
        return await asyncio.to_thread(self.encodings, texts, add_special_tokens)

    async def token_strings_off_loop(self, token_ids: list[int]) -> list[str]:
        """`token_strings` in a thread: a Tokenize of a megabyte has hundreds of thousands."""
        return await asyncio.to_thread(self.token_strings, token_ids)

    async def decode_off_loop(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        texts = await asyncio.to_thread(self.backend.decode_batch, [token_ids], skip_special_tokens=skip_special_tokens)
        return str(texts[0])

    async def encode_within(
        self, field: str, text: str, add_special_tokens: bool, limits: RequestLimits, name: str = "max_tokenize_bytes"
    ) -> list[int]:
        """`encode_off_loop` of a text within RequestLimits `name` (INVALID_ARGUMENT naming
        `field` beyond it): what a Tokenize call gets."""
        check_text_bytes(field, (text,), limits, name)
        return await self.encode_off_loop(text, add_special_tokens)

    async def decode_within(
        self, token_ids: Sequence[int], skip_special_tokens: bool, limits: RequestLimits, vocab_size: int
    ) -> str:
        """`decode_off_loop` of at most max_detokenize_tokens ids inside the vocabulary (counted
        before anything walks them): what a Detokenize call gets."""
        check_count("token_ids", len(token_ids), "tokens", limits, "max_detokenize_tokens")
        ids = list(token_ids)
        if ids and (min(ids) < 0 or max(ids) >= vocab_size):
            i, token = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size)
            raise InvalidArgument(f"token_ids[{i}]", f"token id {token} is outside the vocabulary (size {vocab_size})")
        return await self.decode_off_loop(ids, skip_special_tokens)
