"""`llmserve.v1.Worker`: the handshake and the step stream, over one ModelRunner.

One scheduler drives a worker at a time: a second Execute caller waits STREAM_TAKEOVER_S for
the stream in progress to end (a reconnecting scheduler's old one may still be closing), and
is refused with FAILED_PRECONDITION if it does not; the stream in progress goes on. Plans are
bounded before anything is built from them (common/worker_wire.py `decode_plan`, the runner's
checks): a plan that fails ends the stream with INVALID_ARGUMENT. At most MAX_PLANS_AHEAD wait
behind the running step: the scheduler sends one ahead, or one per micro-batch to a pipeline,
and a caller that sends more is refused the same way, rather than queueing plans without bound.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import AsyncIterator
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import structlog

from common import worker_wire
from common.config import MAX_MICROBATCHES
from common.pb.llmserve.v1 import worker_pb2 as worker_pb
from common.pb.llmserve.v1 import worker_pb2_grpc
from common.plan import StepPlan, StepResult
from common.worker_info import MAX_KV_BLOCKS
from worker_svc.device.parallel import bind_device
from worker_svc.service.metrics import WorkerMetrics
from worker_svc.step.runner import ModelRunner, PlanError

log = structlog.get_logger(__name__)

STREAM_TAKEOVER_S = 10.0
# Plans decoded and waiting for their step: the scheduler keeps two in flight (one running,
# one waiting, and briefly a third as the first result goes out), or in a pipeline one per
# micro-batch, which a stage may all hold while the stages before it run ahead.
MAX_PLANS_AHEAD = max(4, MAX_MICROBATCHES)


@dataclass(frozen=True)
class _Received:
    msg: worker_pb.StepPlan
    plan: StepPlan | None  # None when it did not decode
    error: PlanError | None
    decode_seconds: float


async def _read_plans(
    request_iterator: AsyncIterator[worker_pb.StepPlan],
    out: asyncio.Queue[_Received | None],
    max_seqs: int,
    vocab_size: int,
) -> None:
    """Decode every plan of the stream into `out` as it arrives; None when the stream ends.
    A plan that does not decode, or one past MAX_PLANS_AHEAD, is queued as its error and
    ends the reading: `out` never holds more than MAX_PLANS_AHEAD + 2 entries."""
    try:
        async for msg in request_iterator:
            start = time.perf_counter()
            if out.qsize() >= MAX_PLANS_AHEAD:
                ahead = PlanError(f"more than {MAX_PLANS_AHEAD} plans sent ahead of their results")
                out.put_nowait(_Received(msg, None, ahead, 0.0))
                return
            error: PlanError | None
            try:
                plan, error = worker_wire.decode_plan(msg, max_seqs, vocab_size), None
            except ValueError as bad:  # a malformed plan is refused like one that fails the checks
                plan, error = None, PlanError(str(bad))
            out.put_nowait(_Received(msg, plan, error, time.perf_counter() - start))
            if error is not None:
                return
    finally:
        out.put_nowait(None)


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        runner: ModelRunner,
        model_name: str,
        metrics: WorkerMetrics | None = None,
        executor: Executor | None = None,
    ) -> None:
        self._runner = runner
        self._model_name = model_name
        self._metrics = metrics
        # One thread runs every forward pass: steps are sequential by nature, and the event
        # loop stays free to answer health checks while a step runs. The worker process hands
        # its main thread, the one that loaded the model (worker_svc/service/main_thread.py says why);
        # without one, a thread of our own, bound to the runner's device before its first step
        # (see parallel.bind_device).
        self._executor = executor or ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="forward", initializer=bind_device, initargs=(runner.device,)
        )
        self._stream_lock = asyncio.Lock()
        # The handshake reports at most the KV blocks a scheduler accepts (a tiny model on a big
        # device may fit more): the scheduler then uses the first MAX_KV_BLOCKS of the cache.
        info = runner.info(model_name)
        self._info = dataclasses.replace(
            info,
            num_gpu_blocks=min(info.num_gpu_blocks, MAX_KV_BLOCKS),
            num_cpu_blocks=min(info.num_cpu_blocks, MAX_KV_BLOCKS),
        )
        # What a plan may size (decode_plan): the KV blocks and vocabulary the handshake reports.
        self._bounds = (self._info.num_gpu_blocks, info.vocab_size)

    async def Describe(  # noqa: N802 (gRPC method name)
        self, request: worker_pb.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb.WorkerInfo:
        return worker_wire.encode_worker_info(self._info)

    async def Execute(  # noqa: N802 (gRPC method name)
        self, request_iterator: AsyncIterator[worker_pb.StepPlan], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb.StepResult]:
        # Two schedulers writing one KV cache would corrupt each other's sequences. A scheduler
        # that reconnects may find its old stream still closing, so wait for it a little.
        try:
            await asyncio.wait_for(self._stream_lock.acquire(), STREAM_TAKEOVER_S)
        except TimeoutError:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this worker is already driven by a scheduler")
        # Read once: the context must not be touched after the server stops (the stream's
        # generator is closed later, when the event loop shuts down, and peer() would crash).
        peer = context.peer()
        log.info("step_stream_opened", peer=peer)
        loop = asyncio.get_running_loop()
        profile = self._runner.config.profile_steps
        last_encode = 0.0  # seconds the previous result took to encode, reported with the next
        # Plans are read and decoded as they arrive. One the scheduler sent ahead starts the
        # moment the step before it ends, before that step's result is even sent.
        plans: asyncio.Queue[_Received | None] = asyncio.Queue()
        reader = asyncio.create_task(_read_plans(request_iterator, plans, *self._bounds), name="read-plans")

        def start(received: _Received | None) -> tuple[_Received, asyncio.Future[StepResult]] | None:
            if received is None:
                return None
            if received.error is not None:
                failed: asyncio.Future[StepResult] = loop.create_future()
                failed.set_exception(received.error)
                return received, failed
            if received.plan is None:  # an undecodable plan always carries its error
                raise RuntimeError("a received plan with neither a plan nor an error")
            return received, loop.run_in_executor(self._executor, self._runner.execute, received.plan)

        running: tuple[_Received, asyncio.Future[StepResult]] | None = None
        try:
            running = start(await plans.get())
            while running is not None:
                received, step = running
                msg = received.msg
                try:
                    result = await step
                    if self._metrics is not None:
                        self._metrics.observe(received.plan, result.execute_seconds)  # type: ignore[arg-type]
                except PlanError as error:
                    # Only the runner's checks refuse a plan. Any other error, a ValueError from a
                    # kernel or the device included, is this rank failing to run a valid plan.
                    log.error("plan_refused", step_id=msg.step_id, reason=str(error))
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"step {msg.step_id}: {error}")
                except Exception as error:  # noqa: BLE001
                    if self._runner.config.world_size > 1:  # tensor-parallel ranks or pipeline stages
                        # A collective failed (a peer died or stalled past the timeout), or this
                        # rank's device or kernels did and its peers wait for it in a collective
                        # it will never join: the group is broken for good and every later step
                        # would fail or hang. Exit, so the group's launcher ends the other ranks too.
                        log.error(
                            "rank_failed",
                            rank=self._runner.config.rank,
                            world_size=self._runner.config.world_size,
                            step_id=msg.step_id,
                            reason=str(error),
                        )
                        os._exit(3)
                    raise
                ahead = not plans.empty()
                if ahead:  # the next plan is here: run it while this result goes out
                    running = start(plans.get_nowait())
                if profile:
                    result.part_seconds.update(plan_decode=received.decode_seconds, result_encode=last_encode)
                encode_start = time.perf_counter()
                reply = worker_wire.encode_result(result)
                last_encode = time.perf_counter() - encode_start
                yield reply
                if not ahead:
                    running = start(await plans.get())
            if reader.done() and not reader.cancelled() and reader.exception() is not None:
                raise reader.exception()  # type: ignore[misc]  # the stream broke: as if read here
        finally:
            reader.cancel()
            if running is not None:
                # A step started ahead whose result nobody will read (the stream ended while
                # the one before it was going out): its outcome is dropped, not left unretrieved.
                running[1].add_done_callback(lambda f: f.cancelled() or f.exception())
            self._stream_lock.release()
            log.info("step_stream_closed", peer=peer)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
