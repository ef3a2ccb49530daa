"""Grammars for structured outputs: compiled once per text, one matcher per sequence.

xgrammar does the work: `GrammarCompiler` turns a StructuredOutput into a compiled grammar
against the model's tokenizer (cached by its text), `Grammar` is one sequence's matcher, and
`fill_masks` writes the packed token bitmasks of a step's constrained rows (int32
[rows, ceil(vocab / 32)], bit j of word w allows token 32 w + j), which the plan carries to
the worker.

xgrammar's Python package imports torch and transformers, which the scheduler's own modules
never do (tests/test_layout.py), so it is imported on the first constrained request only, in
the thread that compiles it; a scheduler that serves none never loads it.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np

from common.errors import InvalidArgument, Unimplemented
from scheduler_svc.text.structured_output import StructuredOutput, choice_grammar

# Grammars kept compiled; a compiled JSON schema is tens of KB.
_CACHE_SIZE = 256
# Where xgrammar's messages say they were raised: "[07:06:16] /project/cpp/regex_converter.cc:83: ".
_SOURCE_PREFIX = re.compile(r"\[[0-9:]+\] \S+:\d+: ")


class GrammarCompiler:
    def __init__(self, model_dir: str, vocab_size: int, stop_token_ids: frozenset[int], max_whitespace: int) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.stop_token_ids = sorted(stop_token_ids)
        # JSON allows any amount of whitespace between tokens; a model that starts emitting it
        # may never stop (a random-weight one surely does not), so runs of it are bounded.
        self.max_whitespace = max_whitespace
        self._compiler: Any = None
        self._batch: Any = None  # fills the masks of many matchers at once
        self._lock = threading.Lock()
        self._cached = functools.lru_cache(maxsize=_CACHE_SIZE)(self._compile)

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled grammar; InvalidArgument with the compiler's reason when the schema,
        regex or grammar is not valid. Slow the first time (xgrammar and the tokenizer's
        vocabulary load): call it from a thread, not the event loop."""
        self._xgrammar_compiler()  # outside the try: a failure to set up is not the client's
        try:
            return self._cached(spec.key)
        except (RuntimeError, ValueError, TypeError) as error:
            # xgrammar reports a bad schema, regex or grammar as one of these, with its reason
            # after a "[time] source.cc:line: " prefix that is no business of the client's.
            reason = _SOURCE_PREFIX.sub("", str(error)).strip()
            raise InvalidArgument(f"{spec.field}.{spec.kind}", f"cannot be compiled: {reason}") from error

    def grammar(self, spec: StructuredOutput) -> Grammar:
        """A fresh matcher for one sequence (compiling the grammar if it is new)."""
        compiled = self.compile(spec)  # first: it says so when xgrammar is missing
        import xgrammar

        return Grammar(xgrammar.GrammarMatcher(compiled), self._batch, self.words)

    def _xgrammar_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar
                    from transformers import PreTrainedTokenizerFast
                except ImportError as error:
                    # The slim scheduler image leaves them out (Dockerfile).
                    raise Unimplemented(
                        f"structured_output: this scheduler's installation lacks {error.name}, which "
                        "structured outputs need (the slim scheduler image leaves out xgrammar and torch; "
                        "run the scheduler from the worker image to serve them)"
                    ) from error

                tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(Path(self.model_dir) / "tokenizer.json"))
                info = xgrammar.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None
                )
                # The scheduler's event loop, its gRPC threads and often a worker share the
                # cores: half of them fill masks (one thread here was faster than two on two
                # cores, benchmarks/structured_output_bench.py).
                threads = max(1, len(os.sched_getaffinity(0)) // 2)
                self._batch = xgrammar.BatchGrammarMatcher(max_threads=threads)
                # Its own cache never forgets (a client sending a new schema per request would
                # grow the scheduler without bound): the bounded one here serves instead.
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
            return self._compiler

    def _compile(self, key: tuple[str, str, tuple[str, ...]]) -> Any:
        kind, text, choices = key
        compiler = self._xgrammar_compiler()
        if kind == "json_schema":
            return compiler.compile_json_schema(text, any_whitespace=True, max_whitespace_cnt=self.max_whitespace)
        if kind == "json_object":
            return compiler.compile_json_schema(
                json.dumps({"type": "object"}), any_whitespace=True, max_whitespace_cnt=self.max_whitespace
            )
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(choices))
        return compiler.compile_grammar(text)


class Grammar:
    """One sequence's place in its grammar. Forks copy it; preemption and moving the sequence
    to another worker group keep it, since it lives with the sequence."""

    def __init__(self, matcher: Any, batch: Any, words: int) -> None:
        self._matcher = matcher
        self._batch = batch
        self.words = words  # of its masks: ceil(vocab_size / 32)

    def accept(self, token: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it."""
        return bool(self._matcher.accept_token(token))

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: the sequence ends."""
        return bool(self._matcher.is_terminated())

    def fork(self) -> Grammar:
        return Grammar(self._matcher.fork(), self._batch, self.words)


def fill_masks(grammars: list[Grammar]) -> np.ndarray:
    """int32 [len(grammars), words]: the tokens each grammar allows next (xgrammar's threads
    fill the rows in parallel). The grammars come from one compiler."""
    if not grammars:
        return np.zeros((0, 0), np.int32)
    masks = np.full((len(grammars), grammars[0].words), -1, np.int32)
    grammars[0]._batch.batch_fill_next_token_bitmask([g._matcher for g in grammars], masks)
    return masks
