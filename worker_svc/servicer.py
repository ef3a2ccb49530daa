"""`llmserve.v1.Worker`: the handshake and the step stream, over one ModelRunner."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import structlog

from common.pb.llmserve.v1 import worker_pb2 as worker_pb
from common.pb.llmserve.v1 import worker_pb2_grpc
from worker_svc import wire
from worker_svc.metrics import WorkerMetrics
from worker_svc.runner import ModelRunner, PlanError

log = structlog.get_logger(__name__)

STREAM_TAKEOVER_S = 10.0


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, runner: ModelRunner, model_name: str, metrics: WorkerMetrics | None = None) -> None:
        self._runner = runner
        self._model_name = model_name
        self._metrics = metrics
        # One thread runs every forward pass: steps are sequential by nature, and the event
        # loop stays free to answer health checks while a step runs.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
        self._stream_lock = asyncio.Lock()

    async def Describe(  # noqa: N802 (gRPC method name)
        self, request: worker_pb.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb.WorkerInfo:
        return wire.worker_info(self._runner.info(self._model_name))

    async def Execute(  # noqa: N802 (gRPC method name)
        self, request_iterator: AsyncIterator[worker_pb.StepPlan], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb.StepResult]:
        # Two schedulers writing one KV cache would corrupt each other's sequences. A scheduler
        # that reconnects may find its old stream still closing, so wait for it a little.
        try:
            await asyncio.wait_for(self._stream_lock.acquire(), STREAM_TAKEOVER_S)
        except TimeoutError:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this worker is already driven by a scheduler")
        log.info("step_stream_opened", peer=context.peer())
        loop = asyncio.get_running_loop()
        profile = self._runner.config.profile_steps
        last_encode = 0.0  # seconds the previous result took to encode, reported with the next
        try:
            async for msg in request_iterator:
                try:
                    decode_start = time.perf_counter()
                    plan = wire.step_plan(msg)
                    decode_seconds = time.perf_counter() - decode_start
                    result = await loop.run_in_executor(self._executor, self._runner.execute, plan)
                    if self._metrics is not None:
                        self._metrics.observe(plan, result.execute_seconds)
                except (ValueError, PlanError) as error:
                    log.error("plan_refused", step_id=msg.step_id, reason=str(error))
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"step {msg.step_id}: {error}")
                except Exception as error:  # noqa: BLE001
                    group = self._runner.group
                    if group.world_size > 1:
                        # A collective failed (a peer died or stalled past the timeout): this
                        # rank's group is broken for good and every later step would fail or
                        # hang. Exit, so the group's launcher ends the other ranks too.
                        log.error("rank_failed", rank=group.rank, world_size=group.world_size,
                                  step_id=msg.step_id, reason=str(error))
                        os._exit(3)
                    raise
                if profile:
                    result.part_seconds.update(plan_decode=decode_seconds, result_encode=last_encode)
                encode_start = time.perf_counter()
                reply = wire.step_result(result)
                last_encode = time.perf_counter() - encode_start
                yield reply
        finally:
            self._stream_lock.release()
            log.info("step_stream_closed", peer=context.peer())

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
