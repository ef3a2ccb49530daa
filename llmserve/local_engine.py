"""The engine of one offline `LLM`: its worker processes, and the scheduler's engine running on
an event loop in a thread of its own.

It is `llmserve up` without the public port: the same worker command lines
(llmserve/cli/worker.py), on unix sockets in a private mkdtemp directory, supervised and
restarted the same way, and the same `Engine` the scheduler service serves, called directly
instead of through gRPC. Nothing listens on TCP, and the workers' sockets take only the random
worker token this engine makes and hands them in their environment (LLMSERVE_WORKER_TOKEN).

The workers are started from the engine's thread, not the caller's: a worker asks the kernel
for SIGTERM when the thread that started it ends (PR_SET_PDEATHSIG), and this thread lives
exactly as long as the engine does, whichever thread made the `LLM`.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import tempfile
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import structlog

from common.errors import InvalidArgument, LlmserveError, NotFound, Unimplemented
from common.model_spec import ModelSpec
from llmserve.cli.configs import WORKER_TOKEN_ENV
from llmserve.cli.up import gpu_share
from llmserve.cli.worker import worker_args
from llmserve.engine_args import EngineArgs
from llmserve.rank_launcher import rank_addresses
from llmserve.supervisor import Supervised
from scheduler_svc.engine.engine import Engine
from scheduler_svc.engine.request import GenerationRequest, RequestOutput
from scheduler_svc.text.chat_template import ChatTemplate
from scheduler_svc.text.tokenizer import Tokenizer
from scheduler_svc.workers.rank_links import RankLinks
from scheduler_svc.workers.worker_client import WorkerClient, WorkerLink

log = structlog.get_logger("llmserve")

T = TypeVar("T")

# A worker loads its model (and, on CPU, builds its kernels the first time) before it answers.
READY_TIMEOUT_S = 600.0


class LocalEngine:
    def __init__(self, args: EngineArgs, ready_timeout: float = READY_TIMEOUT_S) -> None:
        self.model = args.model
        self.tokenizer = Tokenizer(args.model)
        self.chat_template = ChatTemplate.from_dir(args.model)
        self.sockdir = tempfile.mkdtemp(prefix="llmserve-llm-")
        self.workers: list[Supervised] = []
        self._engine: Engine | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="llmserve-engine", daemon=True)
        self._thread.start()
        try:
            self.call(self._start(args, ready_timeout))
        except BaseException:
            self.close()
            raise

    @property
    def engine(self) -> Engine:
        if self._engine is None or self._closed:
            raise RuntimeError("the LLM is closed")
        return self._engine

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the engine's loop and wait for it; engine errors become Python's
        (ValueError for a bad request, with the message a gRPC client would get)."""
        if self._closed:
            coro.close()
            raise RuntimeError("the LLM is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except LlmserveError as error:
            raise python_error(error) from error
        except BaseException:  # e.g. KeyboardInterrupt while waiting: abort what is in flight
            future.cancel()
            raise

    async def _start(self, args: EngineArgs, timeout: float) -> None:
        a = args.flags
        links: list[WorkerLink] = []
        # The worker plane's token for this engine's own workers, and only them.
        token = secrets.token_urlsafe(32)
        for i in range(a.workers):
            address = f"unix://{self.sockdir}/worker-{i}.sock"
            cmd = [
                *worker_args(a, args.model),
                "--listen",
                address,
                "--parent-pid",
                str(os.getpid()),
                "--tp",
                str(a.tp),
            ]
            # A session of its own: Ctrl-C in a terminal (SIGINT to the foreground process group)
            # interrupts the caller's generate, not the worker, which keeps serving the next call.
            env = {**(gpu_share(i, a.tp * a.pp, a.workers) or os.environ), WORKER_TOKEN_ENV: token}
            worker = Supervised(cmd, env=env, own_session=True)
            worker.start()
            self.workers.append(worker)
            ranks = rank_addresses(address, a.tp * a.pp)
            links.append(RankLinks(ranks, token=token) if len(ranks) > 1 else WorkerClient(address, token=token))
        self._engine = Engine(
            ModelSpec.from_dir(args.model), self.tokenizer, args.scheduler, links, chat_template=self.chat_template
        )
        self._engine.start()
        deadline = self._loop.time() + timeout
        while not self._engine.ready:
            for started in self.workers:
                if started.proc is not None and started.proc.poll() is not None:
                    raise RuntimeError(
                        f"the worker exited with code {started.proc.returncode} before it was ready (see its log above)"
                    )
            if self._loop.time() > deadline:
                raise TimeoutError(f"the worker was not ready after {timeout:.0f} s")
            await asyncio.sleep(0.05)
        self._supervisor = asyncio.create_task(self._supervise())

    async def _supervise(self) -> None:
        """What `llmserve up` does every second: a worker that died is started again (after a
        backoff) and the engine reconnects to it; its requests meanwhile fail or move."""
        while True:
            for worker in self.workers:
                worker.restart_if_dead()
            await asyncio.sleep(1.0)

    def generate(
        self, requests: Sequence[GenerationRequest], on_finished: Callable[[int], None]
    ) -> list[list[RequestOutput]]:
        """Every request in flight at once (the scheduler batches them); each one's streamed
        pieces, in request order. The first failure aborts the others and is raised."""
        return self.call(self._generate(requests, on_finished))

    async def _generate(
        self, requests: Sequence[GenerationRequest], on_finished: Callable[[int], None]
    ) -> list[list[RequestOutput]]:
        engine = self.engine
        # A full queue refuses requests (RESOURCE_EXHAUSTED); an offline batch waits for room.
        room = asyncio.Semaphore(engine.config.max_queue_len)

        async def one(i: int, req: GenerationRequest) -> list[RequestOutput]:
            async with room:
                pieces = [piece async for piece in engine.generate(req)]
            on_finished(i)
            return pieces

        return await _all_or_none([one(i, r) for i, r in enumerate(requests)])

    def close(self) -> None:
        """Stop the engine and the workers, end the thread, remove the socket directory.
        Idempotent; also what a forgotten LLM's finalizer calls at exit."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=60.0)
            except Exception:  # noqa: BLE001 (shutting down: the processes are ended below anyway)
                log.exception("llm_stop_failed")
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10.0)
        if not self._thread.is_alive():
            self._loop.close()
        for worker in self.workers:
            worker.stop()
        shutil.rmtree(self.sockdir, ignore_errors=True)

    async def _stop(self) -> None:
        if self._supervisor is not None:
            self._supervisor.cancel()
        if self._engine is not None:
            await self._engine.stop()
        for worker in self.workers:
            worker.stop()
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in rest:
            task.cancel()
        await asyncio.gather(*rest, return_exceptions=True)


async def _all_or_none(coros: Sequence[Awaitable[T]]) -> list[T]:
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def python_error(error: LlmserveError) -> Exception:
    """The builtin exception a Python caller expects for an engine error, with its message."""
    if isinstance(error, InvalidArgument):
        return ValueError(str(error))
    if isinstance(error, Unimplemented):
        return NotImplementedError(str(error))
    if isinstance(error, NotFound):
        return LookupError(str(error))
    return RuntimeError(f"{type(error).__name__}: {error}")
