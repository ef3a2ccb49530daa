"""The child process that tries grammars before the scheduler compiles them, and the
scheduler's handle on it.

xgrammar compiles in C++ and cannot be interrupted: a compile that runs past its timeout in a
thread would go on burning a core after its request was refused, and a client could start any
number of them. In a process of its own it can be killed, at the timeout or when its request
is cancelled, and a fresh one takes its place; a crash of the C++ code on a hostile grammar
ends the child, not the scheduler. The child runs at nice 10, so a compile takes the CPU only
when the event loop and the workers leave it.

The child compiles the grammar, times its first token mask and measures it; the scheduler then
compiles the same text itself (at nice 10 too), knowing that it ends, and how soon. Compiling
twice costs CPU that nothing else wanted; bringing the child's result over would cost memory:
xgrammar's serialized form of a string schema of maxLength 100,000 is 12.6 MB, and reading it
back takes 100 MB for a moment. One grammar is tried at a time; others wait their turn in the
`CompileLane`, a bounded number of them, each for at most the compile timeout (grammar.py).

Run as `python -m scheduler_svc.text.grammar_process FD`, FD being its end of a socket pair.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

# The first message after a (re)start: the child imports xgrammar (and torch) in seconds.
STARTUP_TIMEOUT_S = 120.0
_ROOT = str(Path(__file__).resolve().parents[2])  # where `scheduler_svc` is importable from


class CompileTimeout(Exception):
    """The compile ran past its timeout; the child was killed."""


class CompilerGone(Exception):
    """The child ended during a compile: killed by a cancel, or crashed on the grammar."""


class CompilerProcess:
    """Blocking calls, for a thread: `compile` waits for the child; `cancel` (any thread)
    kills it if it is compiling for the given ticket."""

    def __init__(self, setup: dict[str, Any]) -> None:
        self._setup = setup  # model_dir, vocab_size, stop_token_ids, threads
        self._turn = threading.Lock()  # one compile at a time
        self._state = threading.Lock()  # the child and who it works for, against cancel()
        self._child: _Child | None = None
        self._running: object | None = None
        self._ready = False
        # The child goes with its handle, whoever forgets to close it (and at exit).
        self._children: list[_Child] = []
        self._finalizer = weakref.finalize(self, _Child.stop_all, self._children)
        self._spawn()

    def compile(self, request: tuple[Any, ...], timeout: float, ticket: object) -> tuple[Any, ...]:
        """The child's reply to `request` (kind, text, choices, max_whitespace, max_bytes):
        ("ok", first_mask_seconds), ("invalid", reason), or ("too_big", bytes) for a compiled
        grammar over max_bytes. CompileTimeout past `timeout` seconds of compiling (the wait
        for a turn, bounded by the caller's lane, and for the child's start do not count);
        CompilerGone if it ended meanwhile."""
        with self._turn:
            child = self._started()
            with self._state:
                self._running = ticket
            try:
                child.conn.send(request)
                if not child.conn.poll(timeout):
                    self._replace(child)
                    raise CompileTimeout
                reply: tuple[Any, ...] = child.conn.recv()
                return reply
            except (EOFError, OSError) as error:
                code = self._replace(child)
                raise CompilerGone(f"the grammar compiler ended (exit code {code})") from error
            finally:
                with self._state:
                    self._running = None

    def cancel(self, ticket: object) -> None:
        """Kill the child if it is compiling for `ticket` (a request that went away); the
        compiling thread then sees it end and starts another."""
        with self._state:
            if self._running is ticket and self._child is not None:
                self._child.kill()

    def close(self) -> None:
        self._finalizer()  # once: later calls do nothing
        with self._state:
            self._child = None

    @property
    def pid(self) -> int | None:
        return self._child.proc.pid if self._child is not None else None

    def _spawn(self) -> None:
        child = _Child.start(self._setup)
        with self._state:
            self._child, self._ready = child, False
            self._children[:] = [child]

    def _started(self) -> _Child:
        if self._child is None:
            self._spawn()
        elif self._child.proc.poll() is not None:  # it died while idle
            self._replace(self._child)
        child = self._child
        assert child is not None
        if not self._ready:
            if not child.conn.poll(STARTUP_TIMEOUT_S):
                self._replace(child)
                raise CompilerGone(f"the grammar compiler did not start within {STARTUP_TIMEOUT_S:.0f} s")
            try:
                hello = child.conn.recv()
            except EOFError:
                code = self._replace(child)
                raise CompilerGone(f"the grammar compiler failed to start (exit code {code})") from None
            if hello[0] != "ready":
                self._replace(child)
                raise CompilerGone(f"the grammar compiler failed to start: {hello[1]}")
            self._ready = True
        return child

    def _replace(self, child: _Child) -> int | None:
        """End `child` (killed if still running) and start its successor, which loads while
        nothing needs it; the exit code of the one ended."""
        code = child.stop()
        self._spawn()
        return code


class CompileLane:
    """The compile lane: one compile at a time, in the order they came, with at most `depth`
    distinct grammars waiting (a request for a grammar already waiting or compiling rides
    along: its turn finds it compiled). Each waiter gives a `notify(turn)`, called (under
    the lane's lock: it must not block) with True at its turn, False when the lane closes; it
    returns False when nobody can hear it any more, and the next waiter's turn comes. No
    method blocks: the event loop calls them."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._lock = threading.Lock()
        self._queue: deque[tuple[object, bytes, Callable[[bool], bool]]] = deque()  # the next first
        self._digests: dict[bytes, int] = {}  # of the waiting grammars: how many wait for each
        self._holder: tuple[object, bytes] | None = None  # whose compile runs, of what

    @property
    def waiting(self) -> int:
        """Distinct grammars waiting."""
        with self._lock:
            return len(self._digests)

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._holder is not None

    def join(self, ticket: object, digest: bytes, notify: Callable[[bool], bool]) -> bool:
        """Queue `ticket`; False, not queued, when its grammar would be the depth + 1-th
        distinct one waiting."""
        with self._lock:
            new = digest not in self._digests and (self._holder is None or self._holder[1] != digest)
            if new and len(self._digests) >= self.depth:
                return False
            self._queue.append((ticket, digest, notify))
            self._digests[digest] = self._digests.get(digest, 0) + 1
            self._hand_on()
            return True

    def give_up(self, ticket: object) -> bool:
        """`ticket` waits no longer (its request went away or waited too long); True when its
        turn had come meanwhile: the lane is then its own, to use or `release`."""
        with self._lock:
            for entry in self._queue:
                if entry[0] is ticket:
                    self._queue.remove(entry)
                    self._forget(entry[1])
                    return False
            return self._holder is not None and self._holder[0] is ticket

    def release(self, ticket: object) -> None:
        """`ticket`'s compile ended: the next one's turn."""
        with self._lock:
            if self._holder is not None and self._holder[0] is ticket:
                self._holder = None
                self._hand_on()

    def close(self) -> None:
        with self._lock:
            while self._queue:
                self._queue.popleft()[2](False)
            self._digests.clear()

    def _hand_on(self) -> None:
        while self._holder is None and self._queue:
            ticket, digest, notify = self._queue.popleft()
            self._forget(digest)
            if notify(True):
                self._holder = (ticket, digest)

    def _forget(self, digest: bytes) -> None:
        left = self._digests[digest] - 1
        if left:
            self._digests[digest] = left
        else:
            del self._digests[digest]


class _Child:
    def __init__(self, proc: subprocess.Popen[bytes], conn: Connection) -> None:
        self.proc = proc
        self.conn = conn

    @classmethod
    def start(cls, setup: dict[str, Any]) -> _Child:
        ours, theirs = socket.socketpair()
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH", "")) if p),
            "OMP_NUM_THREADS": "1",  # torch comes with xgrammar; it computes nothing here
            "TOKENIZERS_PARALLELISM": "false",
        }
        with theirs:
            proc = subprocess.Popen(
                [sys.executable, "-m", "scheduler_svc.text.grammar_process", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=env,
            )
        conn = Connection(ours.detach())
        conn.send(setup)
        return cls(proc, conn)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    def stop(self) -> int | None:
        self.kill()
        try:
            code = self.proc.wait(10)
        except subprocess.TimeoutExpired:
            code = None
        self.conn.close()
        return code

    @staticmethod
    def stop_all(children: list[_Child]) -> None:
        for child in children:
            child.stop()


# ---- the child ----


def _serve(conn: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the scheduler ends it (or its socket does)
    os.nice(10)
    setup = conn.recv()
    try:
        import numpy as np
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(Path(setup["model_dir"]) / "tokenizer.json"))
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=setup["vocab_size"], stop_token_ids=setup["stop_token_ids"] or None
        )
        compiler = xgrammar.GrammarCompiler(info, max_threads=setup["threads"], cache_enabled=False)
        mask = np.full((1, (setup["vocab_size"] + 31) // 32), -1, np.int32)
    except Exception as error:  # whatever it is, the scheduler reports it
        conn.send(("failed", f"{type(error).__name__}: {error}"))
        return
    conn.send(("ready",))
    while True:
        try:
            kind, text, choices, max_whitespace, max_bytes = conn.recv()
        except EOFError:
            return  # the scheduler closed its end, or ended
        try:
            compiled = compile_with(compiler, kind, text, choices, max_whitespace)
        except (RuntimeError, ValueError, TypeError) as error:
            conn.send(("invalid", str(error)))
            continue
        if compiled.memory_size_bytes > max_bytes:
            conn.send(("too_big", compiled.memory_size_bytes))
            continue
        # CPU seconds, not wall: at nice 10 on a busy machine the wall clock says little.
        start = time.thread_time()
        xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(mask, 0)
        conn.send(("ok", time.thread_time() - start))


def compile_with(compiler: Any, kind: str, text: str, choices: list[str], max_whitespace: int) -> Any:
    """What xgrammar's `compiler` makes of a StructuredOutput's fields (here and in the scheduler)."""
    import json

    if kind == "json_schema":
        return compiler.compile_json_schema(text, any_whitespace=True, max_whitespace_cnt=max_whitespace)
    if kind == "json_object":
        return compiler.compile_json_schema(
            json.dumps({"type": "object"}), any_whitespace=True, max_whitespace_cnt=max_whitespace
        )
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "choice":
        from scheduler_svc.text.structured_output import choice_grammar

        return compiler.compile_grammar(choice_grammar(tuple(choices)))
    return compiler.compile_grammar(text)


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
