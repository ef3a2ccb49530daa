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

import structlog

from common.config import SchedulerConfig
from common.errors import Aborted, Cancelled, InvalidArgument, ResourceExhausted, Unavailable
from common.model_spec import ModelSpec
from common.plan import StepPlan, StepResult
from common.worker_info import WorkerInfo
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.chat_template import ChatTemplate
from scheduler_svc.engine_stats import EngineStats
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.load import GroupLoad, Load, ModelInfo
from scheduler_svc.request import (
    GenerationRequest,
    Limits,
    RequestOutput,
    check_fields,
    check_length,
    sampling_params,
    stopping_params,
)
from scheduler_svc.request_stream import RequestStream
from scheduler_svc.scheduler import Scheduler, TokenEvent
from scheduler_svc.sequence import Sequence
from scheduler_svc.sequence_group import SequenceGroup
from scheduler_svc.tokenizer import Tokenizer
from scheduler_svc.worker_client import StepTiming, WorkerClient, WorkerLink, WorkerLost
from scheduler_svc.worker_group import WorkerGroup

log = structlog.get_logger(__name__)

# Inbox items: a new group to add, or the stream of a request to abort.
_Inbox = list["SequenceGroup | RequestStream"]


class Engine:
    def __init__(
        self,
        spec: ModelSpec,
        tokenizer: Tokenizer,
        config: SchedulerConfig,
        worker: WorkerClient | WorkerGroup | None,
        metrics: SchedulerMetrics | None = None,
        on_ready: Callable[[bool], Awaitable[None]] | None = None,
        connect_timeout: float = 30.0,
        chat_template: ChatTemplate | None = None,
        worker_factory: Callable[[list[str]], WorkerClient | WorkerGroup] | None = None,
    ) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.config = config
        # A fixed worker (--worker), or None: then registered groups are used (see attach_group).
        self._static = worker
        self.worker: WorkerLink = worker or _NoWorker()
        self._worker_factory = worker_factory
        self._registered: dict[str, WorkerLink] = {}
        self._registered_changed = asyncio.Event()
        self.metrics = metrics or SchedulerMetrics(spec.name)
        self._on_ready = on_ready
        self._connect_timeout = connect_timeout
        self.scheduler: Scheduler | None = None
        self.limits = Limits.of(spec, config)
        self._inbox: _Inbox = []
        self._wake = asyncio.Event()
        self._streams: dict[str, RequestStream] = {}
        self._arrivals = itertools.count()
        self._block_bytes = 0
        self._task: asyncio.Task[None] | None = None
        self._stats = EngineStats()
        self._reported = (0, 0, 0)
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
        for worker in self._registered.values():
            await worker.close()

    def attach_group(self, name: str, addresses: list[str]) -> None:
        """A registered group has all its ranks: serve with it if nothing else serves."""
        if self._worker_factory is None:
            return
        self._registered[name] = self._worker_factory(addresses)
        self._registered_changed.set()

    def detach_group(self, name: str) -> None:
        """A rank of a registered group left: the group is gone (its KV spans every rank)."""
        worker = self._registered.pop(name, None)
        if worker is not None and worker is self.worker:
            # Breaking its stream makes a step in flight fail over (WorkerLost, then the next
            # group); an idle loop is woken to notice.
            asyncio.get_running_loop().create_task(worker.close())
            self._wake.set()
        self._registered_changed.set()

    async def _next_worker(self) -> bool:
        """Registry mode: make a registered group current; False while none is registered."""
        if self._static is not None:
            return True
        if self.worker in self._registered.values():
            return True
        candidate = next(iter(self._registered.values()), None)
        if candidate is None:
            self.worker = _NoWorker()
            self._registered_changed.clear()
            await self._registered_changed.wait()
            return False
        self.worker = candidate
        return True

    async def _main(self) -> None:
        while True:
            if not await self._next_worker():
                continue
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
                # A registered group that cannot serve this model is dropped, not retried.
                for name, worker in list(self._registered.items()):
                    if worker is self.worker:
                        del self._registered[name]
                await asyncio.sleep(0 if self._static is None else 5.0)
                continue
            self.limits = Limits.of(self.spec, self.config, min(self.spec.max_model_len, info.max_model_len))
            self._reported = (0, 0, 0)
            self._block_bytes = info.block_bytes
            self.scheduler = Scheduler(
                self.config,
                BlockManager(
                    info.num_gpu_blocks,
                    info.block_size,
                    num_cpu_blocks=info.num_cpu_blocks,
                    enable_prefix_caching=self.config.enable_prefix_caching,
                ),
                max_model_len=self.limits.max_model_len,
                eos_token_ids=self.spec.eos_token_ids,
                block_bytes=info.block_bytes,
            )
            log.info(
                "worker_ready",
                address=self.worker.address,
                device=info.device,
                dtype=info.dtype,
                num_gpu_blocks=info.num_gpu_blocks,
                num_cpu_blocks=info.num_cpu_blocks,
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
            lambda s: Aborted(f"{what} after {s.num_output_tokens} tokens were streamed")
            if s.num_output_tokens
            else Unavailable(f"{what}; retry the request")
        )
        # Nothing runs or waits any more and no KV is held: say so, rather than leaving the
        # gauges at their last values until a worker is back.
        for gauge in (self.metrics.running, self.metrics.waiting, self.metrics.swapped,
                      self.metrics.kv_usage, self.metrics.cpu_usage):
            gauge.set(0)

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

    def _fail_all(self, error_for: Callable[[RequestStream], Exception]) -> None:
        for stream in self._streams.values():
            stream.fail(error_for(stream))
        self._streams.clear()
        self._inbox.clear()
        if self.scheduler is not None:
            self.scheduler.abort_all()

    # ---- requests ----

    async def generate(self, req: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Validate, queue, and stream the outputs of one request."""
        stream = self._admit(req)
        # Every log line of this handler's task carries the request id from here on.
        structlog.contextvars.bind_contextvars(request_id=stream.request_id)
        done = False
        try:
            while True:
                item = await stream.queue.get()
                if item is None or isinstance(item, Exception):
                    done = True
                    if item is None:
                        return
                    raise item
                yield item
        finally:
            if not done:
                self._abort(stream)

    def _admit(self, req: GenerationRequest) -> RequestStream:
        scheduler = self.scheduler
        if self._draining:
            raise Unavailable("the server is shutting down")
        if scheduler is None:
            raise Unavailable("no ready worker: the service is warming up or its worker is down")
        check_fields(req, self.limits)
        tokens = self.prompt_tokens(req.prompt, req.prompt_token_ids, req.messages)
        check_length(len(tokens), req.max_tokens, self.limits)
        request_id = req.request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise InvalidArgument("request_id", f"{request_id!r} is already in flight")
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        sampling = sampling_params(req, seed, self.limits)
        total = len(tokens) + (req.max_tokens or self.limits.max_model_len - len(tokens))
        width = max(sampling.best_of, sampling.beam_width)
        for name, limit in (("max_num_seqs", self.config.max_num_seqs), ("max_num_batched_tokens", self.config.max_num_batched_tokens)):
            if width > limit:
                field = "sampling.beam_width" if sampling.beam_width > 1 else "sampling.best_of"
                raise InvalidArgument(field, f"{width} sequences exceed this server's --{name.replace('_', '-')} ({limit})")
        if not scheduler.can_ever_fit(len(tokens), total, width):
            bm = scheduler.block_manager
            need = scheduler.blocks_for_group(len(tokens), total, width)
            raise ResourceExhausted(
                f"the request needs {need} KV blocks ({width} x up to {total} tokens), more than the whole "
                f"cache holds ({bm.num_blocks} blocks of {bm.block_size}); lower stopping.max_tokens, "
                f"the prompt length, n, best_of or beam_width"
            )
        queued = scheduler.num_waiting + sum(isinstance(i, SequenceGroup) for i in self._inbox)
        if queued >= self.config.max_queue_len:
            raise ResourceExhausted(
                f"the waiting queue is full ({queued} requests, --max-queue-len {self.config.max_queue_len}); retry later"
            )
        arrival = next(self._arrivals)
        seq = Sequence(
            seq_id=scheduler.new_seq_id(),
            request_id=request_id,
            prompt_token_ids=tokens,
            sampling=sampling,
            stopping=stopping_params(req),
            arrival=arrival,
        )
        group = SequenceGroup(request_id, [seq], sampling, arrival, priority=req.priority)
        stream = RequestStream(group, self.tokenizer, self._block_bytes)
        self._streams[request_id] = stream
        self._inbox.append(group)
        self._wake.set()
        self.metrics.prompt_tokens.inc(len(tokens))
        log.info(
            "request_admitted",
            request_id=request_id,
            prompt_tokens=len(tokens),
            max_tokens=req.max_tokens,
            priority=req.priority,
            n=sampling.n,
            best_of=sampling.best_of,
            beam_width=sampling.beam_width,
        )
        return stream

    def prompt_tokens(self, text: str, token_ids: tuple[int, ...], messages: tuple[tuple[str, str], ...]) -> list[int]:
        """The prompt's token ids, from whichever of the three forms was given."""
        if token_ids:
            return list(token_ids)
        if messages:
            if self.chat_template is None:
                raise InvalidArgument("messages", f"model {self.spec.name!r} has no chat template; send a prompt")
            # The rendered conversation holds its special tokens already.
            return self.tokenizer.encode(self.chat_template.render(list(messages)), add_special_tokens=False)
        return self.tokenizer.encode(text)

    def model_info(self) -> ModelInfo:
        block_size = self.scheduler.block_manager.block_size if self.scheduler is not None else 0
        return ModelInfo(
            model_name=self.spec.name,
            max_model_len=self.limits.max_model_len,
            vocab_size=self.spec.vocab_size,
            eos_token_ids=tuple(sorted(self.spec.eos_token_ids)),
            block_size=block_size,
            has_chat_template=self.chat_template is not None,
            limits=self.limits,
            max_queue_len=self.config.max_queue_len,
        )

    def load(self) -> Load | None:
        """Queue lengths and KV usage; None while no worker is ready."""
        sched = self.scheduler
        if sched is None:
            return None
        bm = sched.block_manager
        group = GroupLoad(self.worker.address, bm.num_blocks, bm.num_free_blocks, bm.cpu.num_blocks, bm.cpu.num_free, sched.num_running)
        return Load(sched.num_running, sched.num_waiting, sched.num_swapped, (group,))

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Abort in-flight requests by id (their streams end CANCELLED); unknown ids are ignored."""
        aborted = []
        for request_id in dict.fromkeys(request_ids):
            stream = self._streams.get(request_id)
            if stream is not None and not stream.aborted:
                stream.aborted = True
                stream.fail(Cancelled(f"request {request_id!r} was aborted by an Abort call"))
                self._abort(stream)
                aborted.append(request_id)
        if aborted:
            log.info("requests_aborted", request_ids=aborted)
        return aborted

    def _abort(self, stream: RequestStream) -> None:
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
            if isinstance(item, SequenceGroup):
                stream = self._streams.get(item.request_id)
                if stream is not None and stream.group is item:
                    scheduler.add(item)
            elif self._streams.get(item.request_id) is item:
                del self._streams[item.request_id]
                scheduler.abort(item.group.group_id)
                log.info("request_aborted", request_id=item.request_id, completion_tokens=item.num_output_tokens)

    async def _loop(self, scheduler: Scheduler) -> None:
        while True:
            if self._static is None and self.worker not in self._registered.values():
                raise WorkerLost(f"{self.worker.address} deregistered")
            self._wake.clear()
            self._apply_inbox(scheduler)
            self._publish_gauges(scheduler)
            plan = scheduler.schedule() if scheduler.has_work else None
            if plan is None:
                await self._wake.wait()
                continue
            self._observe_admissions(scheduler)
            with structlog.contextvars.bound_contextvars(step_id=plan.step_id):
                result, timing = await self.worker.execute(plan)
                events = scheduler.update(plan, result)
                self._emit(scheduler, events)
                # Sampled rows, not events: beam steps sample every beam but emit only at the end.
                self._record(plan.step_id, plan.num_seqs, plan.num_tokens, int(plan.sample.sum()), timing)

    def _emit(self, scheduler: Scheduler, events: list[TokenEvent]) -> None:
        touched: dict[str, RequestStream] = {}
        now = time.monotonic()
        for event in events:
            stream = self._streams.get(event.seq.request_id)
            if stream is None or stream.group is not event.seq.group:
                continue
            if event.token_id >= 0:
                stream.on_token(event, scheduler)
                if stream.first_token_time is None:
                    stream.first_token_time = now
                    self.metrics.ttft.observe(now - stream.arrival_time)
                elif stream.last_token_time is not None and stream.last_token_time < now:
                    self.metrics.itl.observe(now - stream.last_token_time)
                stream.last_token_time = now
            touched[stream.request_id] = stream
        # Only after every event of the step: a stop string on one sample can end the group
        # while a sibling's last token of the same step is still to be sent.
        for stream in touched.values():
            if stream.group.is_finished:
                self._close(stream)

    def _close(self, stream: RequestStream) -> None:
        stream.finish()
        del self._streams[stream.request_id]
        self.metrics.e2e.observe(time.monotonic() - stream.arrival_time)
        stats = stream.stats()
        log.info(
            "request_finished",
            request_id=stream.request_id,
            finish_reasons=[s.finish_reason.value for s in stream.group.seqs if s.finish_reason],
            prompt_tokens=stream.group.seqs[0].num_prompt_tokens,
            completion_tokens=stream.num_output_tokens,
            prefix_cache_hit_tokens=stats.prefix_cache_hit_tokens,
            preemptions=stats.num_preemptions,
            swaps=stats.num_swaps,
            swapped_bytes=stats.swapped_bytes,
        )

    def _observe_admissions(self, scheduler: Scheduler) -> None:
        now = time.monotonic()
        for group in scheduler.admitted:
            stream = self._streams.get(group.request_id)
            if stream is not None and stream.group is group and not stream.scheduled:
                stream.scheduled = True
                self.metrics.queue_time.observe(now - stream.arrival_time)

    def _publish_gauges(self, scheduler: Scheduler) -> None:
        m = self.metrics
        m.running.set(scheduler.num_running)
        m.waiting.set(scheduler.num_waiting)
        m.swapped.set(scheduler.num_swapped)
        bm = scheduler.block_manager
        m.kv_usage.set(bm.num_used_blocks / bm.num_blocks)
        m.cpu_usage.set(bm.cpu.num_used / bm.cpu.num_blocks if bm.cpu.num_blocks else 0.0)

    def _record(self, step_id: int, num_seqs: int, num_tokens: int, num_sampled: int, timing: StepTiming) -> None:
        m = self.metrics
        m.plan_bytes.observe(timing.plan_bytes)
        m.roundtrip.observe(timing.roundtrip_seconds)
        m.generation_tokens.inc(num_sampled)
        sched = self.scheduler
        if sched is not None:
            # The scheduler keeps plain counters (it is pure); publish what moved since last step.
            now = (sched.num_preemptions, sched.prefix_queried_tokens, sched.prefix_hit_tokens)
            for counter, new, old in zip((m.preemptions, m.prefix_queries, m.prefix_hits), now, self._reported):
                if new > old:
                    counter.inc(new - old)
            self._reported = now
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


class _NoWorker:
    """Stands in while no registered group exists (registry mode): never connected."""

    address = "(none registered)"

    async def connect(self, timeout: float) -> WorkerInfo:
        raise WorkerLost("no worker has registered")

    async def execute(self, plan: StepPlan) -> tuple[StepResult, StepTiming]:
        raise WorkerLost("no worker has registered")

    async def close(self) -> None:
        pass
