"""Grammars for structured outputs: compiled once per text, one matcher per sequence.

xgrammar does the work: `GrammarCompiler` turns a StructuredOutput into a compiled grammar
against the model's tokenizer, once a child process (which a timeout or a cancel kills) has
compiled it first (`grammar_process`), and keeps it in a cache bounded in bytes
(`grammar_cache`), and gives each sequence its matcher (`grammar_matcher.Grammar`, whose
module fills a step's token masks).

xgrammar's Python package imports torch and transformers, which the scheduler's own modules
never do (tests/test_layout.py), so it is imported on the first constrained request only, in
the thread that compiles it; a scheduler that serves none never loads it.

A step waits for its masks, so one grammar whose masks are slow would slow every sequence of
its worker group: a mask may take MASK_BUDGET_S. A grammar whose first mask takes longer is
refused when it compiles (RESOURCE_EXHAUSTED); one that grows slower as it goes (ambiguous
grammars do: `([a-z]{0,1000}){0,1000}` takes 15 ms more per token) is ended at the first step
over the budget, its next token refused.

New grammars compile one at a time (the child process is one, and compiling takes a core): the
others wait in the compile lane (`CompileLane`), at most MAX_WAITING_COMPILES distinct ones,
each for at most --grammar-compile-timeout; past either, RESOURCE_EXHAUSTED. A cached grammar
never waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from common.errors import InvalidArgument, ResourceExhausted, Unavailable, Unimplemented
from common.request_limits import RequestLimits
from scheduler_svc.text.grammar_cache import GrammarCache
from scheduler_svc.text.grammar_matcher import MASK_BUDGET_S, Grammar, MaskFiller
from scheduler_svc.text.grammar_process import (
    CompileLane,
    CompilerGone,
    CompilerProcess,
    CompileTimeout,
    compile_with,
)
from scheduler_svc.text.input_limits import DEFAULT_LIMITS
from scheduler_svc.text.structured_output import StructuredOutput

# A compiled grammar may take this share of the cache's bytes at most (--grammar-cache-mb / 8).
GRAMMAR_CACHE_SHARE = 8
# Where xgrammar's messages say they were raised: "[07:06:16] /project/cpp/regex_converter.cc:83: ".
_SOURCE_PREFIX = re.compile(r"\[[0-9:]+\] \S+:\d+: ")
_MAX_REASON = 500  # characters of the compiler's reason a refusal quotes
# Distinct new grammars that may wait for the compile lane; the next is refused at once. A
# usual schema takes 5-20 ms (both compiles, the child's and the scheduler's, measured with
# SmolLM2's 49k vocabulary), so 64 are served in about a second (a few seconds if a vocabulary
# three times larger costs three times as much): within the 10 s a waiter may wait by default.
# Tens of new schemas at once fit (tests/test_structured_output.py sends 30). More would only
# be refused later: once a slow grammar holds the lane (up to about twice the compile timeout:
# the child's compile, then the scheduler's), its waiters reach their deadline unserved;
# refused at once, a client retries or falls back instead of waiting on a stranger's grammars.
# A waiter costs no thread: its request's future and text, held anyway.
MAX_WAITING_COMPILES = 64


class GrammarCompiler:
    def __init__(self, model_dir: str, vocab_size: int, stop_token_ids: frozenset[int], max_whitespace: int) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.stop_token_ids = sorted(stop_token_ids)
        # JSON allows any amount of whitespace between tokens; a model that starts emitting it
        # may never stop (a random-weight one surely does not), so runs of it are bounded.
        self.max_whitespace = max_whitespace
        self.cache = GrammarCache()
        self._compiler: Any = None  # xgrammar's, in this process
        self._filler: MaskFiller | None = None
        self._process: CompilerProcess | None = None
        self._lock = threading.Lock()
        self._lane = CompileLane(MAX_WAITING_COMPILES)
        # The compile whose turn it is runs here, off the event loop, below its priority as
        # the child does; the others wait in the lane, on the loop.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile", initializer=_lower_priority)

    def compile(self, spec: StructuredOutput, limits: RequestLimits = DEFAULT_LIMITS, ticket: object = None) -> Any:
        """The compiled grammar; InvalidArgument with the compiler's reason when the schema,
        regex or grammar is not valid, ResourceExhausted past limits.grammar_compile_timeout
        (of compiling, or of waiting for the compile lane) or with the lane's queue full.
        Blocks (seconds the first time, while xgrammar loads): call it from a thread."""
        self._setup()  # outside the refusals: a failure to set up is not the client's
        compiled = self.cache.get(spec.digest)
        if compiled is not None:
            return compiled  # never waits, never refused
        ticket = ticket if ticket is not None else object()
        told = threading.Event()
        outcome: list[bool] = []

        def notify(turn: bool) -> bool:
            outcome.append(turn)
            told.set()
            return True

        self._join(spec, ticket, notify)
        timeout = limits.grammar_compile_timeout
        if not told.wait(timeout):
            outcome.append(self._lane.give_up(ticket))
        self._check_turn(spec, outcome[0], timeout)
        return self._compile_held(spec, limits, ticket)

    def _join(self, spec: StructuredOutput, ticket: object, notify: Callable[[bool], bool]) -> None:
        """Queue `ticket` for the compile lane, or refuse at once when it is full."""
        if not self._lane.join(ticket, spec.digest, notify):
            raise ResourceExhausted(
                f"{_where(spec)}: {self._lane.depth} grammar compiles are already waiting; retry later"
            )

    @staticmethod
    def _check_turn(spec: StructuredOutput, turn: bool, timeout: float) -> None:
        # The wait is bounded on its own rather than counted into the compile's timeout: a
        # compile started late would be killed half done (its CPU wasted), and refused as
        # "took longer", blaming a grammar that never had its time.
        if not turn:
            raise ResourceExhausted(
                f"{_where(spec)}: waited {timeout:g} s (--grammar-compile-timeout) for other "
                "grammar compiles to end; retry later"
            )

    def _compile_held(self, spec: StructuredOutput, limits: RequestLimits, ticket: object) -> Any:
        """`compile` once the lane is `ticket`'s; it hands the lane on, whatever happens."""
        try:
            process = self._setup()
            compiled = self.cache.get(spec.digest)  # the same grammar may have compiled meanwhile
            return compiled if compiled is not None else self._compile_now(process, spec, limits, ticket)
        finally:
            self._lane.release(ticket)

    def _compile_now(
        self, process: CompilerProcess, spec: StructuredOutput, limits: RequestLimits, ticket: object
    ) -> Any:
        """The compile itself, the lane being `ticket`'s."""
        where = _where(spec)
        timeout = limits.grammar_compile_timeout
        max_bytes = limits.grammar_cache_bytes // GRAMMAR_CACHE_SHARE
        request = (spec.kind, spec.text, list(spec.choices), self.max_whitespace, max_bytes)
        try:
            reply = process.compile(request, timeout, ticket)
        except CompileTimeout:
            raise ResourceExhausted(
                f"{where}: grammar compile took longer than {timeout:g} s; raise --grammar-compile-timeout"
            ) from None
        except CompilerGone as error:
            raise ResourceExhausted(f"{where}: compiling it ended the compiler: {error}") from None
        if reply[0] == "invalid":
            raise _invalid(where, reply[1])
        if reply[0] == "too_big":
            raise ResourceExhausted(
                f"{where}: compiled, it takes {reply[1] / 2**20:.0f} MiB, over 1/{GRAMMAR_CACHE_SHARE} of "
                f"--grammar-cache-mb ({limits.grammar_cache_bytes / 2**20:.0f} MiB)"
            )
        if reply[1] > MASK_BUDGET_S:
            raise ResourceExhausted(
                f"{where}: its token masks take {reply[1] * 1e3:.0f} ms, over the "
                f"{MASK_BUDGET_S * 1e3:.0f} ms a step may spend on one"
            )
        # The child compiled this text within the timeout: the same compile here ends as soon.
        try:
            compiled = compile_with(self._compiler, spec.kind, spec.text, list(spec.choices), self.max_whitespace)
        except (RuntimeError, ValueError, TypeError) as error:
            raise _invalid(where, str(error)) from error
        self.cache.put(spec.digest, compiled, int(compiled.memory_size_bytes), limits.grammar_cache_bytes)
        return compiled

    def grammar(self, spec: StructuredOutput, limits: RequestLimits = DEFAULT_LIMITS, ticket: object = None) -> Grammar:
        """A fresh matcher for one sequence (compiling the grammar if it is new); blocks."""
        return self._matcher(self.compile(spec, limits, ticket))  # first: it says when xgrammar is missing

    async def grammar_off_loop(self, spec: StructuredOutput, limits: RequestLimits) -> Grammar:
        """`grammar` in the compile thread once the lane is its own, unless the cache has it:
        a compile in progress delays no request for a grammar compiled before. It waits for
        the lane on the loop (refused at once when full, or at the timeout); a request
        cancelled while it waits leaves the queue, and while its grammar compiles it ends
        the compile (the child process is killed and replaced)."""
        compiled = self.cache.get(spec.digest)
        if compiled is not None:
            return self._matcher(compiled)
        loop = asyncio.get_running_loop()
        if self._process is None:
            # xgrammar loads (seconds) before the request waits for the lane, not in its wait;
            # the first request also says here when it is missing.
            await loop.run_in_executor(self._pool, self._setup)
        ticket = object()
        turn: asyncio.Future[bool] = loop.create_future()

        def notify(granted: bool) -> bool:
            try:
                loop.call_soon_threadsafe(_settle, turn, granted)
            except RuntimeError:  # its loop is closed: nobody waits
                return False
            return True

        self._join(spec, ticket, notify)
        timeout = limits.grammar_compile_timeout
        try:
            await asyncio.wait({turn}, timeout=timeout)
        except asyncio.CancelledError:
            if self._lane.give_up(ticket):  # its turn came meanwhile: the next one's
                self._lane.release(ticket)
            raise
        granted = turn.result() if turn.done() else self._lane.give_up(ticket)
        turn.cancel()
        self._check_turn(spec, granted, timeout)
        try:
            job = self._pool.submit(self._grammar_held, spec, limits, ticket)
        except BaseException:
            self._lane.release(ticket)
            raise
        # A job cancelled before it starts never runs: the lane goes on without it.
        job.add_done_callback(lambda done: self._lane.release(ticket) if done.cancelled() else None)
        try:
            return await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            if self._process is not None:
                self._process.cancel(ticket)
            raise

    def _grammar_held(self, spec: StructuredOutput, limits: RequestLimits, ticket: object) -> Grammar:
        return self._matcher(self._compile_held(spec, limits, ticket))

    def _matcher(self, compiled: Any) -> Grammar:
        import xgrammar

        assert self._filler is not None  # set up with the compiler
        return Grammar(xgrammar.GrammarMatcher(compiled), self._filler, self.words)

    def close(self) -> None:
        """End the compiler's process (it also ends with this object, or the scheduler)."""
        self._lane.close()  # the waiting compiles end, refused
        if self._process is not None:
            self._process.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _setup(self) -> CompilerProcess:
        with self._lock:
            if self._process is None:
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
                # The scheduler's event loop, its gRPC threads and often a worker share the
                # cores: half of them compile and fill masks (one thread here was faster than
                # two on two cores, benchmarks/structured_output_bench.py).
                threads = max(1, len(os.sched_getaffinity(0)) // 2)
                setup = {
                    "model_dir": self.model_dir,
                    "vocab_size": self.vocab_size,
                    "stop_token_ids": self.stop_token_ids,
                    "threads": threads,
                }
                try:
                    process = CompilerProcess(setup)  # it loads while this process does
                except OSError as error:
                    raise Unavailable(f"structured_output: the grammar compiler cannot start: {error}") from error
                tokenizer = PreTrainedTokenizerFast(tokenizer_file=os.path.join(self.model_dir, "tokenizer.json"))
                info = xgrammar.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None
                )
                # Its own cache never forgets (a client sending a new schema per request would
                # grow the scheduler without bound): the bounded one here serves instead.
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
                self._filler = MaskFiller(xgrammar.BatchGrammarMatcher(max_threads=threads))
                self._process = process
            return self._process


def _settle(turn: asyncio.Future[bool], granted: bool) -> None:
    if not turn.done():
        turn.set_result(granted)


def _where(spec: StructuredOutput) -> str:
    return f"{spec.field}.{spec.kind}"


def _invalid(where: str, message: str) -> InvalidArgument:
    # xgrammar gives its reason after a "[time] source.cc:line: " prefix that is no business
    # of the client's.
    return InvalidArgument(where, f"cannot be compiled: {_SOURCE_PREFIX.sub('', message).strip()[:_MAX_REASON]}")


def _lower_priority() -> None:
    """The compile thread at nice 10 (Linux sets it per thread; xgrammar's threads inherit it)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
