"""An executor whose calls run on the process's main thread, for the forward passes.

OpenMP (torch's intra-op pool and our C++ kernels) keeps one team of threads per thread that
starts parallel regions. Once a second thread starts them as well (the main thread loaded
the model and warmed it up, a pool thread then runs every step), libgomp manages more
threads than there are cores and stops spinning between regions: every region then wakes
its team through the kernel. A step is hundreds of small regions, so on a 2-core machine a
decode step took 40% longer that way than the same step on the thread that loaded the model
(`benchmarks/throughput.py`'s breakdown: every part slower, the small ops most). So the
worker keeps all model work on its main thread, and its gRPC event loop runs on another one
(`run_beside`), handing steps over through this executor.

`run()` serves calls on the calling thread until `shutdown()`. It wakes a few times a second
even when idle, so that Python runs signal handlers (they run only on the main thread, and
a signal may reach another thread of the process).
"""

from __future__ import annotations

import asyncio
import queue
import signal
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor, Future
from typing import Any

# How long run() blocks for the next call before it looks for signals and shutdown again.
POLL_S = 0.2

_Call = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class MainThreadExecutor(Executor):
    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._serving_thread: int | None = None  # set while run() serves
        self._done = threading.Event()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            future: Future[Any] = Future()
            self._calls.put((future, fn, args, kwargs))
        return future

    def run(self) -> None:
        """Run submitted calls in order on this thread; return once shut down (calls still
        queued then are cancelled). A call's exception goes to its future, not to run()."""
        with self._lock:
            if self._serving_thread is not None:
                raise RuntimeError("MainThreadExecutor.run() is already serving")
            self._serving_thread = threading.get_ident()
        try:
            while True:
                try:
                    future, fn, args, kwargs = self._calls.get(timeout=POLL_S)
                except queue.Empty:
                    if self._closed:
                        return
                    continue
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    result = fn(*args, **kwargs)
                except BaseException as error:  # noqa: BLE001 (the future carries it to the caller)
                    future.set_exception(error)
                else:
                    future.set_result(result)
                del future, fn, args, kwargs  # a finished step's tensors are not kept alive here
        finally:
            self._cancel_queued()
            self._done.set()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No new calls; run() returns after the call it is running (with `cancel_futures`,
        queued ones are cancelled, else run first). `wait` waits for that from another thread."""
        with self._lock:
            self._closed = True
            serving = self._serving_thread
        if cancel_futures:
            self._cancel_queued()
        if wait and serving is not None and threading.get_ident() != serving:
            self._done.wait()

    def _cancel_queued(self) -> None:
        while True:
            try:
                future, *_ = self._calls.get_nowait()
            except queue.Empty:
                return
            future.cancel()


def run_beside(main: MainThreadExecutor, body: Callable[[asyncio.Event], Coroutine[Any, Any, None]]) -> None:
    """Run `body(stop)` in an event loop on a thread of its own while this thread serves
    `main`'s calls, until `body` returns; its exception is raised here.

    The contract of a worker process: call it from the main thread, the one that loaded the
    model, and submit every forward pass to `main` from the event loop, so that one thread
    alone starts OpenMP regions. When `body` ends, `main` shuts down and its queued calls
    are cancelled. SIGINT and SIGTERM set `stop`; Python runs their handlers on the main
    thread, which `main.run()` wakes often enough to do (POLL_S). The previous handlers are
    put back on return.
    """
    signalled = threading.Event()
    shared: dict[str, Any] = {}

    def on_signal(*_: object) -> None:
        signalled.set()
        loop, stop = shared.get("loop"), shared.get("stop")
        if loop is not None and stop is not None:
            loop.call_soon_threadsafe(stop.set)

    async def serve() -> None:
        stop = asyncio.Event()
        shared["loop"], shared["stop"] = asyncio.get_running_loop(), stop
        if signalled.is_set():  # a signal that came before the loop did
            stop.set()
        await body(stop)

    def loop_thread() -> None:
        try:
            asyncio.run(serve())
        except BaseException as error:  # noqa: BLE001 (raised again on the main thread)
            shared["error"] = error
        finally:
            main.shutdown(wait=False, cancel_futures=True)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        thread = threading.Thread(target=loop_thread, name="event-loop")
        thread.start()
        main.run()
        thread.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if "error" in shared:
        raise shared["error"]
