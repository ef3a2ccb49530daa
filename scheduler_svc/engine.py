"""The engine: admission, routing, and one loop per worker group (data-parallel replica).

Each worker group has its own scheduler and block manager (`Replica`) and a loop task that is
the only code touching them:

    while True:
        apply queued adds and aborts          (handlers only append to the group's inbox)
        plan = scheduler.schedule()
        result = await worker.execute(plan)   (the only await while state is mid-step)
        events = scheduler.update(plan, result)
        detokenize, match stop strings, stream to each request's queue

Handlers never touch a scheduler: they validate, pick a group (`Router`), post to its inbox
and read their queue, so an abort (client cancel) takes effect at that group's next step
boundary and frees the blocks then. When a group is lost (its stream broke, it missed the
step deadline, or it deregistered), its requests move with their tokens to the other groups'
queues and are computed again there; with no other group they fail.
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
from common.errors import Aborted, Cancelled, InvalidArgument, Unavailable
from common.model_spec import ModelSpec
from common.worker_info import WorkerInfo
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.chat_template import ChatTemplate
from scheduler_svc.load import Load, ModelInfo
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.replica import Replica
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
from scheduler_svc.router import Router
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.sequence import Sequence
from scheduler_svc.sequence_group import SequenceGroup
from scheduler_svc.step_reporter import StepReporter
from scheduler_svc.tokenizer import Tokenizer
from scheduler_svc.worker_client import WorkerLink, WorkerLost

log = structlog.get_logger(__name__)


class Engine:
    def __init__(
        self,
        spec: ModelSpec,
        tokenizer: Tokenizer,
        config: SchedulerConfig,
        workers: WorkerLink | list[WorkerLink] | None,
        metrics: SchedulerMetrics | None = None,
        on_ready: Callable[[bool], Awaitable[None]] | None = None,
        connect_timeout: float = 30.0,
        chat_template: ChatTemplate | None = None,
        worker_factory: Callable[[list[str]], WorkerLink] | None = None,
    ) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.config = config
        # Fixed worker groups (--worker), or none: then registered groups serve (see attach_group).
        self._static = workers if isinstance(workers, list) else [workers] if workers is not None else []
        self._worker_factory = worker_factory
        # Every worker group known, connected or not, by name.
        self._replicas: dict[str, Replica] = {}
        self._router = Router(config)
        self.metrics = metrics or SchedulerMetrics(spec.name)
        self._on_ready = on_ready
        self._ready_reported: bool | None = None
        # Several group loops report readiness; one at a time, so health's two entries agree.
        self._ready_lock = asyncio.Lock()
        self._connect_timeout = connect_timeout
        self.limits = Limits.of(spec, config)
        self._streams: dict[str, RequestStream] = {}
        self._reporter = StepReporter(self.metrics, self._streams)
        self._arrivals = itertools.count()
        # One id space for every group's scheduler, so a request can move between them.
        self._seq_ids = itertools.count()
        self._draining = False
        self._stopping = False

    @property
    def replicas(self) -> list[Replica]:
        """The worker groups that are connected and serving."""
        return [r for r in self._replicas.values() if r.ready]

    @property
    def ready(self) -> bool:
        return any(r.ready for r in self._replicas.values())

    @property
    def block_size(self) -> int:
        """The KV block size every group must use: configured, else the serving groups' (0: any)."""
        return self.config.block_size or next((r.scheduler.block_manager.block_size for r in self.replicas), 0)  # type: ignore[union-attr]

    @property
    def scheduler(self) -> Scheduler | None:
        """The first serving group's scheduler (the only one with a single worker group)."""
        return next((r.scheduler for r in self.replicas), None)

    # ---- lifecycle ----

    def start(self) -> None:
        for worker in self._static:
            self._add_replica(worker.address, worker)

    async def drain(self, timeout: float) -> None:
        """Refuse new requests and give in-flight ones up to `timeout` seconds to finish."""
        self._draining = True
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        # Registration answers until the server stops, which is after this: a group completing
        # from now on must not start a loop that nothing would stop.
        self._stopping = True
        # Requests end first, as shut down: the loops' teardown below would otherwise fail them
        # as lost workers (ABORTED once they streamed tokens).
        for stream in self._streams.values():
            stream.fail(Unavailable("the server is shutting down"))
        self._streams.clear()
        replicas = list(self._replicas.values())
        for replica in replicas:
            replica.attached = False
            if replica.task is not None:
                replica.task.cancel()
        for replica in replicas:
            if replica.task is not None:
                try:
                    await replica.task
                except asyncio.CancelledError:
                    pass
        for replica in replicas:
            await replica.worker.close()
        self._replicas.clear()

    def attach_group(self, name: str, addresses: list[str]) -> None:
        """A registered group has all its ranks: connect to it and serve with it."""
        if self._worker_factory is None or self._static or self._stopping:
            return
        current = self._replicas.get(name)
        # A group that deregistered may still be tearing down under this name: the new
        # registration replaces it (its teardown leaves a newer replica of the name alone).
        if current is not None and current.attached:
            return
        self._add_replica(name, self._worker_factory(addresses))

    def detach_group(self, name: str) -> None:
        """A rank of a registered group left: the group is gone (its KV spans every rank)."""
        replica = self._replicas.get(name)
        if replica is None:
            return
        replica.attached = False
        # Breaking its stream makes a step in flight fail (WorkerLost) and the group's requests
        # move; an idle loop is woken to notice.
        asyncio.get_running_loop().create_task(replica.worker.close())
        replica.wake.set()

    def _add_replica(self, name: str, worker: WorkerLink) -> None:
        replica = Replica(name, worker)
        self._replicas[name] = replica
        replica.task = asyncio.create_task(self._run(replica), name=f"engine:{name}")

    async def _run(self, replica: Replica) -> None:
        """Connect to the group and serve with it until it is lost; a --worker one is retried."""
        try:
            while replica.attached:
                try:
                    await self._serve(replica)
                except Exception:  # noqa: BLE001
                    # A bug (or a malformed worker) must neither end this task silently nor leave
                    # requests waiting on a dead loop: fail the group's requests (its state is
                    # suspect, so they are not moved), then start it over.
                    log.exception("engine_failed", group=replica.name)
                    groups, aborts = replica.evacuate()
                    self._drop_aborted(aborts)
                    for group in groups:
                        self._fail_stream(group, "internal engine failure (see server logs)")
                await replica.worker.close()
                await self._refresh_ready()
                if replica.attached:
                    await asyncio.sleep(1.0)
        finally:
            if self._replicas.get(replica.name) is replica:
                del self._replicas[replica.name]
            # However the task ended, nothing may stay queued on a group that no longer runs.
            if replica.scheduler is not None or replica.inbox:
                self._recover(replica)
            await replica.worker.close()
            await self._refresh_ready()

    async def _serve(self, replica: Replica) -> None:
        worker = replica.worker
        try:
            info = await worker.connect(self._connect_timeout)
        except WorkerLost as error:
            # Each attempt waits connect_timeout for the channel; then say so and try again.
            log.warning("worker_unreachable", group=replica.name, address=worker.address, reason=str(error), retrying=True)
            return
        problem = self._incompatibility(info)
        if problem:
            log.error("worker_refused", group=replica.name, address=worker.address, reason=problem)
            await worker.close()
            # A registered group that cannot serve this model is dropped; a --worker is retried.
            if not self._static:
                replica.attached = False
            else:
                await asyncio.sleep(4.0)
            return
        replica.info = info
        replica.reported = (0, 0, 0)
        replica.scheduler = Scheduler(
            self.config,
            BlockManager(
                info.num_gpu_blocks,
                info.block_size,
                num_cpu_blocks=info.num_cpu_blocks,
                enable_prefix_caching=self.config.enable_prefix_caching,
            ),
            max_model_len=min(self.spec.max_model_len, info.max_model_len),
            eos_token_ids=self.spec.eos_token_ids,
            block_bytes=info.block_bytes,
            seq_ids=self._seq_ids,
        )
        log.info(
            "worker_ready",
            group=replica.name,
            address=worker.address,
            device=info.device,
            dtype=info.dtype,
            num_gpu_blocks=info.num_gpu_blocks,
            num_cpu_blocks=info.num_cpu_blocks,
            block_size=info.block_size,
            max_model_len=replica.scheduler.max_model_len,
        )
        await self._refresh_ready()
        try:
            await self._loop(replica, replica.scheduler)
        except WorkerLost as error:
            log.error("worker_lost", group=replica.name, address=worker.address, reason=str(error))
            self._recover(replica)

    def _recover(self, lost: Replica) -> None:
        """Move the lost group's requests, with their tokens, to the other groups' queues.

        They are computed again there from their prompt and output so far; streams continue
        where they were, since tokens are only appended once a step's result arrives and
        sampling depends only on (seed, position). Without another group they fail.
        """
        groups, aborts = lost.evacuate()
        self._drop_aborted(aborts)
        targets = [r for r in self.replicas if r is not lost]
        moved = failed = 0
        for group in groups:
            stream = self._streams.get(group.request_id)
            if stream is None or stream.group is not group:
                continue
            target = self._router.place_moved(targets, group)
            if target is None:
                self._fail_stream(group, "the worker was lost")
                failed += 1
                continue
            stream.replica = target
            target.post(group)
            moved += 1
        self.metrics.recovered.inc(moved)
        if moved or failed:
            log.warning("requests_recovered", group=lost.name, moved=moved, failed=failed, to=[t.name for t in targets])

    def _fail_stream(self, group: SequenceGroup, what: str) -> None:
        """End a request that lost its worker: ABORTED if it streamed tokens, else UNAVAILABLE."""
        stream = self._streams.pop(group.request_id, None)
        if stream is None:
            return
        # best_of > n and beams send nothing before the end: their client may simply retry.
        n = stream.num_output_tokens if group.streams else 0
        stream.fail(Aborted(f"{what} after {n} tokens were streamed") if n else Unavailable(f"{what}; retry the request"))

    def _drop_aborted(self, aborts: list[RequestStream]) -> None:
        for stream in aborts:
            if self._streams.get(stream.request_id) is stream:
                del self._streams[stream.request_id]

    async def _refresh_ready(self) -> None:
        """Tell health whether any group serves; limits follow the groups that do."""
        ready = self.replicas
        if ready:
            self.limits = Limits.of(self.spec, self.config, min(r.scheduler.max_model_len for r in ready))  # type: ignore[union-attr]
        else:
            # Nothing runs or waits any more and no KV is held: say so, rather than leaving the
            # gauges at their last values until a worker is back.
            for gauge in (self.metrics.running, self.metrics.waiting, self.metrics.swapped,
                          self.metrics.kv_usage, self.metrics.cpu_usage):
                gauge.set(0)
        for name in self.metrics.group_names() - {r.name for r in ready}:
            self.metrics.remove_group(name)
        if self._on_ready is None:
            return
        async with self._ready_lock:
            serving = self.ready  # again: another loop may have changed it while this one waited
            if self._ready_reported != serving:
                self._ready_reported = serving
                await self._on_ready(serving)

    def _incompatibility(self, info: WorkerInfo) -> str | None:
        if info.model_name != self.spec.name:
            return f"worker serves model {info.model_name!r}, this scheduler serves {self.spec.name!r}"
        if info.vocab_size != self.spec.vocab_size:
            return f"worker vocabulary has {info.vocab_size} tokens, the model's config says {self.spec.vocab_size}"
        if info.num_gpu_blocks <= 0:
            return "worker reports no KV blocks"
        if self.block_size and info.block_size != self.block_size:
            return f"worker uses KV blocks of {info.block_size} tokens, this scheduler {self.block_size}; start it with --block-size {self.block_size}"
        return None

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
        if self._draining:
            raise Unavailable("the server is shutting down")
        ready = self.replicas
        if not ready:
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
        target = self._router.place(ready, tokens, total, max(sampling.best_of, sampling.beam_width), sampling.beam_width > 1)
        arrival = next(self._arrivals)
        seq = Sequence(
            seq_id=next(self._seq_ids),
            request_id=request_id,
            prompt_token_ids=tokens,
            sampling=sampling,
            stopping=stopping_params(req),
            arrival=arrival,
        )
        group = SequenceGroup(request_id, [seq], sampling, arrival, priority=req.priority)
        stream = RequestStream(group, self.tokenizer, target.block_bytes, replica=target)
        self._streams[request_id] = stream
        target.post(group)
        self.metrics.prompt_tokens.inc(len(tokens))
        log.info(
            "request_admitted",
            request_id=request_id,
            group=target.name,
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
        return ModelInfo(
            model_name=self.spec.name,
            max_model_len=self.limits.max_model_len,
            vocab_size=self.spec.vocab_size,
            eos_token_ids=tuple(sorted(self.spec.eos_token_ids)),
            block_size=self.block_size if self.ready else 0,
            has_chat_template=self.chat_template is not None,
            limits=self.limits,
            max_queue_len=self.config.max_queue_len,
        )

    def load(self) -> Load | None:
        """Queue lengths and KV usage, in all and per worker group; None while none serves."""
        groups = [g for g in (r.load() for r in self.replicas) if g is not None]
        if not groups:
            return None
        return Load(sum(g.running for g in groups), sum(g.waiting for g in groups), sum(g.swapped for g in groups), tuple(groups))

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
        newer request that reuses the id. It goes to the group the request is on now, not to a
        newer group registered under the same name while that one tears down.
        """
        replica = stream.replica
        if replica is not None and self._replicas.get(replica.name) is replica:
            replica.post(stream)
        elif self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]

    # ---- the loop (one task per worker group) ----

    def _apply_inbox(self, replica: Replica, scheduler: Scheduler) -> None:
        inbox, replica.inbox = replica.inbox, []
        for i, item in enumerate(inbox):
            try:
                if isinstance(item, SequenceGroup):
                    stream = self._streams.get(item.request_id)
                    if stream is not None and stream.group is item:
                        scheduler.add(item)
                elif self._streams.get(item.request_id) is item:
                    del self._streams[item.request_id]
                    scheduler.abort(item.group.group_id)
                    log.info("request_aborted", request_id=item.request_id, completion_tokens=item.num_output_tokens)
            except Exception:
                # What was not applied stays queued, so the failure path ends those requests too.
                replica.inbox[:0] = inbox[i:]
                raise

    async def _loop(self, replica: Replica, scheduler: Scheduler) -> None:
        while True:
            if not replica.attached:
                raise WorkerLost(f"group {replica.name} deregistered")
            replica.wake.clear()
            self._apply_inbox(replica, scheduler)
            self._reporter.publish_gauges(replica, self.replicas)
            plan = scheduler.schedule() if scheduler.has_work else None
            if plan is None:
                await replica.wake.wait()
                continue
            self._reporter.observe_admissions(scheduler)
            with structlog.contextvars.bound_contextvars(step_id=plan.step_id, group=replica.name):
                result, timing = await replica.worker.execute(plan)
                events = scheduler.update(plan, result)
                self._reporter.emit(scheduler, events)
                # Sampled rows, not events: beam steps sample every beam but emit only at the end.
                self._reporter.record(replica, plan.step_id, plan.num_seqs, plan.num_tokens, int(plan.sample.sum()), timing)
