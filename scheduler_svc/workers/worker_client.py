"""The scheduler's connection to one worker: the handshake, then one bidi stream of steps."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import grpc
import structlog
from grpc_health.v1 import health_pb2_grpc

from common import worker_wire
from common.config import TlsClientConfig
from common.grpc.auth import bearer_metadata
from common.grpc.tls import open_channel
from common.pb.llmserve.v1 import worker_pb2, worker_pb2_grpc
from common.plan import StepPlan, StepResult
from common.worker_info import WorkerInfo, out_of_bounds

log = structlog.get_logger(__name__)

# Consecutive failed health checks after which a connected worker counts as lost.
HEALTH_FAILURES = 3

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
]


class WorkerLink(Protocol):
    """What the engine drives: one worker, or the ranks of a group (`RankLinks`)."""

    address: str

    async def connect(self, timeout: float) -> WorkerInfo: ...
    async def execute(self, plan: StepPlan) -> tuple[StepResult, StepTiming]: ...
    async def close(self) -> None: ...


@runtime_checkable
class PipelinedLink(WorkerLink, Protocol):
    """A link that takes the next plan before the result of the last: `execute` split in two,
    so the engine can send a step planned ahead while the one before it runs."""

    async def submit(self, plan: StepPlan) -> None: ...
    async def receive(self, plan: StepPlan) -> tuple[StepResult, StepTiming]: ...


class WorkerLost(Exception):
    """The worker's stream broke, closed, missed the step deadline, or sent what its plan could
    not have produced."""


class WorkerRefused(WorkerLost):
    """The worker answered the handshake, and what it reported rules it out for good (a group
    whose ranks disagree, numbers out of bounds): retrying would get the same answer."""


@dataclass(frozen=True)
class StepTiming:
    plan_bytes: int
    roundtrip_seconds: float  # plan written to result read
    execute_seconds: float  # the worker's own time for the step (StepResult.execute_seconds)
    encode_seconds: float = 0.0  # encoding the plan
    decode_seconds: float = 0.0  # decoding the result


class WorkerClient:
    def __init__(
        self,
        address: str,
        step_timeout: float = 600.0,
        tls: TlsClientConfig | None = None,
        health_interval: float = 5.0,
        token: str | None = None,
    ) -> None:
        self.address = address
        self.step_timeout = step_timeout
        # The worker token, presented on Describe and Execute (health checks stay open).
        self._metadata = bearer_metadata(token)
        # While connected, the worker's gRPC health is checked this often (0 = never): a frozen
        # or wedged worker is then given up within a few intervals, not after the step timeout.
        self.health_interval = health_interval
        self._watcher: asyncio.Task[None] | None = None
        self._lost_reason = ""
        # None: plaintext, as over the private unix socket `llmserve up` uses.
        self.tls = tls
        self._channel: grpc.aio.Channel | None = None
        self._call: grpc.aio.StreamStreamCall | None = None
        # Plans written and not yet answered: (encoded bytes, encode seconds, when written).
        self._sent: dict[int, tuple[int, float, float]] = {}
        self._last_received = 0.0
        # Results are checked against the vocabulary the worker reported (the fleet refuses a
        # worker whose vocabulary is not the model's).
        self._vocab_size = 0
        self._samples = True

    async def connect(self, timeout: float) -> WorkerInfo:
        """Wait up to `timeout` seconds for the worker, describe it, and open the step stream."""
        await self.close()
        self._channel = open_channel(self.address, self.tls, CHANNEL_OPTIONS)
        stub = worker_pb2_grpc.WorkerStub(self._channel)
        try:
            info = await stub.Describe(
                worker_wire.describe_request(), wait_for_ready=True, timeout=timeout, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as error:
            await self.close()
            raise WorkerLost(f"worker {self.address} did not answer: {error.code().name} {error.details()}") from error
        described = worker_wire.decode_worker_info(info)
        problem = out_of_bounds(described)
        if problem:  # before the step stream opens: nothing goes to such a worker
            await self.close()
            raise WorkerRefused(f"worker {self.address}: {problem}")
        self._vocab_size = described.vocab_size
        # A pipeline stage before the last samples nothing: its results only pace the group.
        self._samples = described.rank >= described.driver_rank
        self._call = stub.Execute(metadata=self._metadata)
        self._sent.clear()
        self._lost_reason = ""
        if self.health_interval > 0:
            self._watcher = asyncio.create_task(self._watch(self._channel), name=f"health:{self.address}")
        return described

    async def _watch(self, channel: grpc.aio.Channel) -> None:
        stub = health_pb2_grpc.HealthStub(channel)
        failures = 0
        while failures < HEALTH_FAILURES:
            await asyncio.sleep(self.health_interval)
            try:
                reply = await stub.Check(worker_wire.health_check_request(), timeout=max(self.health_interval, 1.0))
                serving = worker_wire.is_serving(reply)
            except grpc.aio.AioRpcError:
                serving = False
            failures = 0 if serving else failures + 1
        self._lost_reason = f"worker {self.address} failed {failures} health checks in a row"
        log.error("worker_unhealthy", address=self.address, failures=failures)
        # Cancelling the step stream ends a step in flight (WorkerLost) and refuses the next.
        call, self._call = self._call, None
        if call is not None:
            call.cancel()

    async def execute(self, plan: StepPlan) -> tuple[StepResult, StepTiming]:
        await self.submit(plan)
        return await self.receive(plan)

    async def submit(self, plan: StepPlan) -> None:
        """Send `plan`; its result comes with `receive`. Up to two plans may be sent ahead of
        their results: the worker runs them in order, the second right after the first."""
        start = time.perf_counter()
        msg = worker_wire.encode_plan(plan)
        await self.write(plan, msg, time.perf_counter() - start)

    async def write(self, plan: StepPlan, msg: worker_pb2.StepPlan, encode_seconds: float = 0.0) -> None:
        """Send `plan`, already encoded as `msg` (a group encodes once for all its ranks)."""
        call = self._step_call()
        try:
            await call.write(msg)
        except BaseException as error:  # noqa: BLE001 (mapped to WorkerLost, or re-raised)
            lost = self._lost(call, plan, error)
            if lost is error:
                raise
            raise lost from error
        self._sent[plan.step_id] = (msg.ByteSize(), encode_seconds, time.perf_counter())

    async def receive(self, plan: StepPlan) -> tuple[StepResult, StepTiming]:
        """The result of `plan`, the oldest plan sent."""
        call = self._step_call()
        try:
            reply = await asyncio.wait_for(call.read(), self.step_timeout)
        except BaseException as error:  # noqa: BLE001 (mapped to WorkerLost, or re-raised)
            lost = self._lost(call, plan, error)
            if lost is error:
                raise
            raise lost from error
        if reply is grpc.aio.EOF:
            raise WorkerLost(f"worker {self.address} closed its step stream")
        received = time.perf_counter()
        try:
            result = worker_wire.decode_result(reply, plan.num_seqs)
            if self._samples:
                worker_wire.check_result(plan, result, self._vocab_size)
        except ValueError as error:
            raise WorkerLost(f"worker {self.address} sent a malformed result: {error}") from error
        if result.step_id != plan.step_id:
            raise WorkerLost(f"worker {self.address} answered step {result.step_id} to plan {plan.step_id}")
        size, encode_seconds, sent = self._sent.pop(plan.step_id, (0, 0.0, received))
        # A plan sent ahead waits for the step before it: its round trip starts when that
        # step's result came back.
        start = max(sent, self._last_received)
        self._last_received = received
        return result, StepTiming(
            size, received - start, result.execute_seconds, encode_seconds, time.perf_counter() - received
        )

    def _step_call(self) -> grpc.aio.StreamStreamCall:
        if self._call is None:
            raise WorkerLost(self._lost_reason or f"worker {self.address} is not connected")
        return self._call

    def _lost(self, call: grpc.aio.StreamStreamCall, plan: StepPlan, error: BaseException) -> BaseException:
        """What a failed write or read of the step stream means for the engine: a WorkerLost,
        or `error` itself when it is not the worker's doing."""
        if isinstance(error, asyncio.CancelledError):
            # close() during the step (the group deregistered) cancels the call, which surfaces
            # here as a cancellation; only a cancelled task should see one.
            if call is not self._call:
                return WorkerLost(self._lost_reason or f"worker {self.address} was closed during step {plan.step_id}")
            return error
        if isinstance(error, (grpc.aio.AioRpcError, asyncio.InvalidStateError)):
            return WorkerLost(f"worker {self.address} failed step {plan.step_id}: {error}")
        if isinstance(error, TimeoutError):
            return WorkerLost(f"worker {self.address} missed the {self.step_timeout}s step deadline")
        return error

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        if self._call is not None:
            self._call.cancel()
            self._call = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
