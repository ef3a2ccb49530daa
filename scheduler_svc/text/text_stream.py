"""Incremental detokenization of one sequence, with stop strings.

Tokens arrive one at a time; text leaves in pieces that never split a multi-byte character
(`tokenizers`' DecodeStream buffers until the bytes decode) and never show a partial stop
string: a tail of the text that could still grow into a stop string is held back until the
next token settles it.

    text so far: "The answer is 4"   stop = ["42!"]
    emitted:     "The answer is "    held: "4"  (might become "42!")
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from scheduler_svc.text.tokenizer import Tokenizer

# Prompt tokens given to the decoder as context, so the first output token decodes as it
# would in the middle of the text (leading spaces of SentencePiece tokenizers).
_CONTEXT_TOKENS = 6


class TextStream:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        include_stop: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        # A prompt may end inside a multi-byte character. Given as context, those tokens would
        # make the first output repeat the context; instead they are stepped through the
        # decoder, which holds their bytes until the output completes the character.
        partial: list[int] = []
        while context and tokenizer.decode(context).endswith("\ufffd"):
            partial.insert(0, context.pop())
        self._decoder = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        for token in partial:
            self._decoder.step(tokenizer.backend, token)
        self._stop = tuple(s for s in stop if s)
        self._include_stop = include_stop
        self._held = ""
        self.matched_stop: str | None = None

    def push(self, token_id: int, match: bool = True) -> str:
        """Add one token; returns the text that can be shown now. Sets `matched_stop` on a match.

        `match` False (before min_tokens) shows the text without looking for stop strings.
        """
        if self.matched_stop is not None:
            return ""
        piece = self._decoder.step(self._tokenizer.backend, token_id) or ""
        if not self._stop:
            return piece
        text = self._held + piece
        if not match:
            self._held = ""
            return text
        cut = min((i for i in (text.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.matched_stop = next(s for s in self._stop if text.find(s) == cut)
            self._held = ""
            return text[: cut + len(self.matched_stop)] if self._include_stop else text[:cut]
        hold = self._partial_stop_suffix(text)
        self._held = text[len(text) - hold :]
        return text[: len(text) - hold]

    def flush(self) -> str:
        """Text held back for a stop string that never came; call once the sequence has ended."""
        text, self._held = self._held, ""
        return text

    def _partial_stop_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
