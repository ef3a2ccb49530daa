"""Incremental detokenization: whole characters only, and no partial stop string shown."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler_svc.text.text_stream import TextStream
from scheduler_svc.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer(smollm2_dir)


def stream_all(stream: TextStream, ids: list[int]) -> list[str]:
    return [stream.push(i) for i in ids]


def test_multibyte_characters_are_never_split(tok: Tokenizer) -> None:
    text = " naïve café 你好 🎉 done"
    ids = tok.encode(text)
    pieces = stream_all(TextStream(tok, tok.encode("Hello")), ids)
    assert "".join(pieces) == text
    assert any(p == "" for p in pieces)  # some tokens carried only part of a character
    for piece in pieces:
        piece.encode("utf-8")  # a lone surrogate or replacement would show up here
        assert "\ufffd" not in piece


def test_text_equals_the_full_decode_difference(tok: Tokenizer) -> None:
    prompt = tok.encode("The quick brown fox")
    out = tok.encode(" jumps over the lazy dog.\nAnd then:  two  spaces")
    pieces = stream_all(TextStream(tok, prompt), out)
    assert "".join(pieces) == tok.decode(prompt + out)[len(tok.decode(prompt)) :]


def test_special_tokens_are_skipped(tok: Tokenizer) -> None:
    ids = tok.encode("hi") + [2] + tok.encode(" there")  # 2 = <|im_end|>
    assert "".join(stream_all(TextStream(tok, []), ids)) == "hi there"


def test_stop_string_across_tokens_is_cut_and_never_shown_partially(tok: Tokenizer) -> None:
    ids = tok.encode("one two STOP three")
    stream = TextStream(tok, [], stop=("STOP",))
    shown = ""
    for token in ids:
        shown += stream.push(token)
        assert "ST" not in shown or "STOP" in shown  # never a visible prefix of the stop string
        if stream.matched_stop:
            break
    assert stream.matched_stop == "STOP"
    assert shown == "one two "


def test_held_text_is_released_when_it_cannot_become_a_stop(tok: Tokenizer) -> None:
    stream = TextStream(tok, [], stop=("xyz!",))
    shown = "".join(stream_all(stream, tok.encode("wxy then more")))
    assert stream.matched_stop is None
    assert shown == "wxy then more"
    stream2 = TextStream(tok, [], stop=("more text",))
    shown2 = "".join(stream_all(stream2, tok.encode("and more")))
    assert shown2 == "and "  # " more" might still become "more text"...
    assert stream2.flush() == "more"  # ...until the sequence ends


def test_earliest_of_several_stop_strings_wins(tok: Tokenizer) -> None:
    stream = TextStream(tok, [], stop=("beta", "alpha"))
    shown = ""
    for token in tok.encode("x alpha beta"):
        shown += stream.push(token)
        if stream.matched_stop:
            break
    assert stream.matched_stop == "alpha" and shown == "x "


def test_prompt_ending_inside_a_character_does_not_repeat_itself(tok: Tokenizer) -> None:
    ids = tok.encode(" a b c d e😀 done")
    cut = next(i for i in range(len(ids)) if tok.decode(ids[: i + 1]).endswith("\ufffd"))
    stream = TextStream(tok, ids[: cut + 1])
    shown = "".join(stream_all(stream, ids[cut + 1 :]))
    assert shown == "😀 done"
