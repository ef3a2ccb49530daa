"""The engine loop: the one task that mutates scheduling state.

    while True:
        apply queued adds and aborts          (handlers only append to the inbox)
        plan = scheduler.schedule()
        result = await worker.execute(plan)   (the only await while state is mid-step)
        events = scheduler.update(plan, result)
        detokenize, match stop strings, stream to each request's queue

Handlers never touch the scheduler: they validate, post to the inbox and read their queue, so
an abort (client cancel) takes effect at the next step boundary and frees the blocks then.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import structlog

from common.config import SchedulerConfig
from common.errors import Aborted, InvalidArgument, ResourceExhausted, Unavailable
from common.model_spec import ModelSpec
from common.worker_info import WorkerInfo
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.engine_stats import EngineStats
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.request import (
    GenerationRequest,
    Limits,
    RequestOutput,
    check_fields,
    check_length,
    sampling_params,
    stopping_params,
)
from scheduler_svc.scheduler import Scheduler, TokenEvent
from scheduler_svc.sequence import FinishReason, Sequence
from scheduler_svc.text_stream import TextStream
from scheduler_svc.tokenizer import Tokenizer
from scheduler_svc.worker_client import StepTiming, WorkerClient, WorkerLost

log = structlog.get_logger(__name__)

# Inbox items: a new sequence to add, or the stream of a request to abort.
_Inbox = list["Sequence | _Stream"]


@dataclass(eq=False)
class _Stream:
    seq: Sequence
    text: TextStream
    queue: asyncio.Queue[RequestOutput | Exception] = field(default_factory=asyncio.Queue)


class Engine:
    def __init__(
        self,
        spec: ModelSpec,
        tokenizer: Tokenizer,
        config: SchedulerConfig,
        worker: WorkerClient,
        metrics: SchedulerMetrics | None = None,
        on_ready: Callable[[bool], Awaitable[None]] | None = None,
        connect_timeout: float = 30.0,
    ) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        self.config = config
        self.worker = worker
        self.metrics = metrics or SchedulerMetrics(spec.name)
        self._on_ready = on_ready
        self._connect_timeout = connect_timeout
        self.scheduler: Scheduler | None = None
        self.limits = Limits.of(spec)
        self._inbox: _Inbox = []
        self._wake = asyncio.Event()
        self._streams: dict[str, _Stream] = {}
        self._seq_ids = itertools.count()
        self._task: asyncio.Task[None] | None = None
        self._stats = EngineStats()
        self._preemptions_reported = 0
        self._draining = False

    @property
    def ready(self) -> bool:
        return self.scheduler is not None

    # ---- lifecycle ----

    def start(self) -> None:
        self._task = asyncio.create_task(self._main(), name="engine")

    async def drain(self, timeout: float) -> None:
        """Refuse new requests and give in-flight ones up to `timeout` seconds to finish."""
        self._draining = True
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self._fail_all(lambda _: Unavailable("the server is shutting down"))
        await self.worker.close()

    async def _main(self) -> None:
        while True:
            try:
                info = await self.worker.connect(self._connect_timeout)
            except WorkerLost as error:
                # Each attempt waits connect_timeout for the channel; then say so and try again.
                log.warning("worker_unreachable", address=self.worker.address, reason=str(error), retrying=True)
                await asyncio.sleep(1.0)
                continue
            problem = self._incompatibility(info)
            if problem:
                log.error("worker_refused", address=self.worker.address, reason=problem)
                await self.worker.close()
                await asyncio.sleep(5.0)
                continue
            self.limits = Limits(vocab_size=self.spec.vocab_size, max_model_len=min(self.spec.max_model_len, info.max_model_len))
            self._preemptions_reported = 0
            self.scheduler = Scheduler(
                self.config,
                BlockManager(info.num_gpu_blocks, info.block_size),
                max_model_len=self.limits.max_model_len,
                eos_token_ids=self.spec.eos_token_ids,
            )
            log.info(
                "worker_ready",
                address=self.worker.address,
                device=info.device,
                dtype=info.dtype,
                num_gpu_blocks=info.num_gpu_blocks,
                block_size=info.block_size,
                max_model_len=self.limits.max_model_len,
            )
            await self._set_ready(True)
            try:
                await self._loop(self.scheduler)
            except WorkerLost as error:
                log.error("worker_lost", address=self.worker.address, reason=str(error))
                await self._fail_in_flight("the worker was lost")
            except Exception:  # noqa: BLE001
                # A bug must not leave requests waiting forever on a dead loop: fail them, then
                # start over with a fresh scheduler (the worker's cache holds nothing we need).
                log.exception("engine_failed")
                await self._fail_in_flight("internal engine failure (see server logs)")
            await self.worker.close()

    async def _fail_in_flight(self, what: str) -> None:
        """End every request: ABORTED for those that streamed tokens, UNAVAILABLE for the rest."""
        await self._set_ready(False)
        self._fail_all(
            lambda s: Aborted(f"{what} after {s.seq.num_output_tokens} tokens were streamed")
            if s.seq.num_output_tokens
            else Unavailable(f"{what}; retry the request")
        )

    def _incompatibility(self, info: WorkerInfo) -> str | None:
        if info.model_name != self.spec.name:
            return f"worker serves model {info.model_name!r}, this scheduler serves {self.spec.name!r}"
        if info.vocab_size != self.spec.vocab_size:
            return f"worker vocabulary has {info.vocab_size} tokens, the model's config says {self.spec.vocab_size}"
        if info.num_gpu_blocks <= 0:
            return "worker reports no KV blocks"
        return None

    async def _set_ready(self, ready: bool) -> None:
        if not ready:
            self.scheduler = None
        if self._on_ready is not None:
            await self._on_ready(ready)

    def _fail_all(self, error_for: Callable[[_Stream], Exception]) -> None:
        for stream in self._streams.values():
            stream.queue.put_nowait(error_for(stream))
        self._streams.clear()
        self._inbox.clear()
        if self.scheduler is not None:
            self.scheduler.abort_all()

    # ---- requests ----

    async def generate(self, req: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Validate, queue, and stream the outputs of one request."""
        stream = self._admit(req)
        request_id = stream.seq.request_id
        # Every log line of this handler's task carries the request id from here on.
        structlog.contextvars.bind_contextvars(request_id=request_id)
        done = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    done = True
                    raise item
                if item.finish_reason is not None:
                    done = True
                yield item
                if done:
                    return
        finally:
            if not done:
                self._abort(stream)

    def _admit(self, req: GenerationRequest) -> _Stream:
        scheduler = self.scheduler
        if self._draining:
            raise Unavailable("the server is shutting down")
        if scheduler is None:
            raise Unavailable("no ready worker: the service is warming up or its worker is down")
        check_fields(req, self.limits)
        tokens = list(req.prompt_token_ids) or self.tokenizer.encode(req.prompt)
        check_length(len(tokens), req.max_tokens, self.limits)
        total = len(tokens) + (req.max_tokens or self.limits.max_model_len - len(tokens))
        if not scheduler.can_ever_fit(total):
            raise ResourceExhausted(
                f"the request needs KV space for {total} tokens, more than the whole cache holds "
                f"({scheduler.block_manager.num_blocks} blocks of {scheduler.block_manager.block_size}); "
                f"lower stopping.max_tokens or the prompt length"
            )
        request_id = req.request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise InvalidArgument("request_id", f"{request_id!r} is already in flight")
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        seq_id = next(self._seq_ids)
        seq = Sequence(
            seq_id=seq_id,
            request_id=request_id,
            prompt_token_ids=tokens,
            sampling=sampling_params(req, seed, self.limits),
            stopping=stopping_params(req),
            arrival=seq_id,
        )
        stream = _Stream(seq, TextStream(self.tokenizer, tokens, tuple(req.stop)))
        self._streams[request_id] = stream
        self._inbox.append(seq)
        self._wake.set()
        self.metrics.prompt_tokens.inc(len(tokens))
        log.info("request_admitted", request_id=request_id, prompt_tokens=len(tokens), max_tokens=req.max_tokens)
        return stream

    def _abort(self, stream: _Stream) -> None:
        """Abort a request (client cancel or deadline); its blocks are freed at the next step.

        The stream object, not the request id, names the request: a late abort must not hit a
        newer request that reuses the id.
        """
        self._inbox.append(stream)
        self._wake.set()

    # ---- the loop ----

    def _apply_inbox(self, scheduler: Scheduler) -> None:
        inbox, self._inbox = self._inbox, []
        for item in inbox:
            if isinstance(item, Sequence):
                stream = self._streams.get(item.request_id)
                if stream is not None and stream.seq is item:
                    scheduler.add(item)
            elif self._streams.get(item.seq.request_id) is item:
                del self._streams[item.seq.request_id]
                scheduler.abort(item.seq.seq_id)
                log.info("request_aborted", request_id=item.seq.request_id, completion_tokens=item.seq.num_output_tokens)

    async def _loop(self, scheduler: Scheduler) -> None:
        while True:
            self._wake.clear()
            self._apply_inbox(scheduler)
            self._publish_gauges(scheduler)
            plan = scheduler.schedule() if scheduler.has_work else None
            if plan is None:
                await self._wake.wait()
                continue
            with structlog.contextvars.bound_contextvars(step_id=plan.step_id):
                result, timing = await self.worker.execute(plan)
                events = scheduler.update(plan, result)
                self._emit(scheduler, events)
                self._record(plan.step_id, plan.num_seqs, plan.num_tokens, len(events), timing)

    def _emit(self, scheduler: Scheduler, events: list[TokenEvent]) -> None:
        for event in events:
            seq = event.seq
            stream = self._streams.get(seq.request_id)
            if stream is None:
                continue
            reason = event.finish_reason
            # A stop token ends the text: it is returned in token_ids, never shown.
            text = "" if reason is FinishReason.STOP else stream.text.push(event.token_id)
            if stream.text.matched_stop is not None:
                # Also when this token reached max_tokens: the stop string is why the text ends.
                if reason is None:
                    scheduler.finish(seq.seq_id, FinishReason.STOP_SEQUENCE)
                reason = FinishReason.STOP_SEQUENCE
            elif reason is not None:
                text += stream.text.flush()
            stream.queue.put_nowait(
                RequestOutput(
                    request_id=seq.request_id,
                    token_ids=[event.token_id],
                    text=text,
                    finish_reason=reason,
                    prompt_tokens=seq.num_prompt_tokens,
                    completion_tokens=seq.num_output_tokens,
                )
            )
            if reason is not None:
                del self._streams[seq.request_id]
                log.info(
                    "request_finished",
                    request_id=seq.request_id,
                    finish_reason=reason.value,
                    prompt_tokens=seq.num_prompt_tokens,
                    completion_tokens=seq.num_output_tokens,
                    preemptions=seq.num_preemptions,
                )

    def _publish_gauges(self, scheduler: Scheduler) -> None:
        m = self.metrics
        m.running.set(scheduler.num_running)
        m.waiting.set(scheduler.num_waiting)
        bm = scheduler.block_manager
        m.kv_usage.set(bm.num_used_blocks / bm.num_blocks)

    def _record(self, step_id: int, num_seqs: int, num_tokens: int, num_sampled: int, timing: StepTiming) -> None:
        m = self.metrics
        m.plan_bytes.observe(timing.plan_bytes)
        m.roundtrip.observe(timing.roundtrip_seconds)
        m.generation_tokens.inc(num_sampled)
        if self.scheduler is not None and self.scheduler.num_preemptions > self._preemptions_reported:
            m.preemptions.inc(self.scheduler.num_preemptions - self._preemptions_reported)
            self._preemptions_reported = self.scheduler.num_preemptions
        log.debug(
            "step",
            step_id=step_id,
            num_seqs=num_seqs,
            num_tokens=num_tokens,
            plan_bytes=timing.plan_bytes,
            roundtrip_ms=round(timing.roundtrip_seconds * 1e3, 3),
            execute_ms=round(timing.execute_seconds * 1e3, 3),
        )
        self._stats.add(num_tokens, num_sampled, timing)
        if self._stats.due() and self.scheduler is not None:
            log.info("engine_stats", **self._stats.summary(self.scheduler))
            self._stats.reset()
