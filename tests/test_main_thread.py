"""The worker's steps run on the thread that loaded the model (worker_svc/service/main_thread.py), its
event loop on another one (its `run_beside`)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from concurrent.futures import CancelledError

import pytest

from worker_svc.service.main_thread import MainThreadExecutor, run_beside


def serve_in_background(executor: MainThreadExecutor) -> threading.Thread:
    thread = threading.Thread(target=executor.run, name="serving")
    thread.start()
    return thread


def test_calls_run_in_order_on_the_serving_thread_and_errors_reach_their_futures() -> None:
    executor = MainThreadExecutor()
    thread = serve_in_background(executor)
    order: list[int] = []

    def call(i: int) -> int:
        order.append(i)
        return threading.get_ident()

    def fail() -> None:
        raise ValueError("bad plan")

    futures = [executor.submit(call, i) for i in range(5)]
    failed = executor.submit(fail)
    assert {f.result(timeout=5) for f in futures} == {thread.ident}
    assert order == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="bad plan"):
        failed.result(timeout=5)
    executor.shutdown(wait=True)
    assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="after shutdown"):
        executor.submit(call, 9)


def test_shutdown_waits_for_the_running_call_and_cancels_the_queued_ones() -> None:
    executor = MainThreadExecutor()
    thread = serve_in_background(executor)
    started = threading.Event()
    release = threading.Event()

    def slow() -> str:
        started.set()
        release.wait(5)
        return "done"

    running = executor.submit(slow)
    queued = executor.submit(lambda: "never")
    assert started.wait(5)
    stopper = threading.Thread(target=executor.shutdown, kwargs={"wait": True, "cancel_futures": True})
    stopper.start()
    time.sleep(0.1)
    assert stopper.is_alive(), "shutdown(wait=True) returned while a call was still running"
    release.set()
    stopper.join(5)
    thread.join(5)
    assert running.result() == "done"
    assert queued.cancelled()
    with pytest.raises(CancelledError):
        queued.result()


def test_without_cancel_futures_queued_calls_still_run() -> None:
    executor = MainThreadExecutor()
    futures = [executor.submit(lambda i=i: i * i) for i in range(3)]
    executor.shutdown(wait=False)
    executor.run()  # returns once the queue is empty: it was shut down
    assert [f.result(timeout=0) for f in futures] == [0, 1, 4]


def test_the_event_loop_runs_beside_the_main_thread_which_runs_the_steps_and_sigterm_stops_it() -> None:
    assert threading.current_thread() is threading.main_thread()
    executor = MainThreadExecutor()
    seen: dict[str, int] = {}

    async def body(stop: asyncio.Event) -> None:
        seen["loop"] = threading.get_ident()
        loop = asyncio.get_running_loop()
        seen["step"] = await loop.run_in_executor(executor, threading.get_ident)
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs on the main thread, inside run()
        await asyncio.wait_for(stop.wait(), 5)
        seen["stopped"] = 1

    before = signal.getsignal(signal.SIGTERM)
    run_beside(executor, body)
    assert seen["step"] == threading.main_thread().ident
    assert seen["loop"] != seen["step"]
    assert seen["stopped"] == 1
    assert signal.getsignal(signal.SIGTERM) is before  # the caller's handlers are back


def test_an_error_of_the_event_loop_is_raised_on_the_main_thread_and_ends_serving() -> None:
    executor = MainThreadExecutor()

    async def body(stop: asyncio.Event) -> None:
        raise OSError("port taken")

    with pytest.raises(OSError, match="port taken"):
        run_beside(executor, body)
    with pytest.raises(RuntimeError, match="after shutdown"):
        executor.submit(print)
