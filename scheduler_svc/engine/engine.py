"""The engine: what the API handlers call. It admits requests, routes each to a worker group,
streams their outputs back, and aborts them; `fleet.Fleet` runs the worker groups.

Handlers never touch a scheduler: they validate, pick a group (`Router`), post to its inbox
and read their queue, so an abort (client cancel) takes effect at that group's next step
boundary and frees the blocks then.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable

import structlog

from common.config import SchedulerConfig
from common.errors import Cancelled, FailedPrecondition, InvalidArgument, Unavailable
from common.model_spec import ModelSpec
from scheduler_svc.engine.fleet import Fleet
from scheduler_svc.engine.kv_event_log import KvEventLog
from scheduler_svc.engine.live_streams import LiveStreams
from scheduler_svc.engine.load import GroupActivity, Load, ModelInfo
from scheduler_svc.engine.metrics import SchedulerMetrics
from scheduler_svc.engine.replica import CacheFlush, Replica
from scheduler_svc.engine.request import (
    GenerationRequest,
    Limits,
    RequestOutput,
    check_fields,
    check_length,
    check_privilege,
    sampling_options,
    stopping_params,
)
from scheduler_svc.engine.request_stream import TRACE_FIELDS, RequestStream
from scheduler_svc.kv.block_manager import BlockManager
from scheduler_svc.lora.adapter_registry import Adapter, AdapterRegistry
from scheduler_svc.sched.sequence import Sequence
from scheduler_svc.sched.sequence_group import SequenceGroup
from scheduler_svc.text.chat_template import ChatTemplate, Messages
from scheduler_svc.text.grammar import Grammar, GrammarCompiler
from scheduler_svc.text.prompt_text import prompt_tokens
from scheduler_svc.text.tokenizer import Tokenizer
from scheduler_svc.workers.worker_client import WorkerLink

log = structlog.get_logger(__name__)

RUNTIME_LORA_OFF = "runtime adapter loading is off; start with --allow-runtime-lora --lora-root DIR"


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
        self.metrics = metrics or SchedulerMetrics(spec.public_name)
        self._streams = LiveStreams()
        static = workers if isinstance(workers, list) else [workers] if workers is not None else []
        self._fleet = Fleet(
            spec, config, self._streams, self.metrics, static, worker_factory, on_ready, connect_timeout
        )
        self._arrivals = itertools.count()
        self._draining = False
        self._grammars = GrammarCompiler(spec.path, spec.vocab_size, spec.eos_token_ids, config.json_max_whitespace)
        # The prefix cache's events of every serving group, for subscribers (the gateway's
        # cache-aware routing); polled only while someone subscribes.
        self.kv_event_log = KvEventLog(self._block_managers)
        self.adapters = AdapterRegistry(spec.path, config.max_lora_rank, config.enable_lora, config.lora_root)
        for name, path in config.lora_modules:  # a bad one stops the server at start, with its reason
            self.adapters.load(name, path)

    @property
    def replicas(self) -> list[Replica]:
        """The worker groups that are connected and serving."""
        return self._fleet.serving

    @property
    def ready(self) -> bool:
        return self._fleet.ready

    @property
    def limits(self) -> Limits:
        return self._fleet.limits

    @property
    def block_size(self) -> int:
        """The KV block size every group must use: configured, else the serving groups' (0: any)."""
        return self._fleet.block_size

    @property
    def num_requests(self) -> int:
        """Requests in flight (queued, running or swapped), in every group."""
        return len(self._streams)

    @property
    def draining(self) -> bool:
        return self._draining

    def _block_managers(self) -> list[BlockManager]:
        """The serving groups' block managers, for the KV event log: it drains their event
        queues and reads their index, and changes nothing else."""
        return [r.scheduler.block_manager for r in self.replicas if r.scheduler is not None]

    # ---- lifecycle ----

    def start(self) -> None:
        self._fleet.start()

    def attach_group(self, name: str, addresses: list[str], refuse: Callable[[str], None] | None = None) -> None:
        """A registered group has all its ranks: serve with it (`refuse(reason)` ends its registration)."""
        self._fleet.attach_group(name, addresses, refuse)

    def detach_group(self, name: str) -> None:
        """A rank of a registered group left: its requests move to the other groups."""
        self._fleet.detach_group(name)

    async def drain(self, timeout: float) -> None:
        """Refuse new requests and give in-flight ones up to `timeout` seconds to finish."""
        self._draining = True
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        # Requests end first, as shut down: the loops' teardown would otherwise fail them as
        # lost workers (ABORTED once they streamed tokens).
        for stream in self._streams.clear():
            stream.fail(Unavailable("the server is shutting down"))
        await self._fleet.stop()
        self._grammars.close()  # its compiler process

    # ---- requests ----

    async def generate(
        self, req: GenerationRequest, cause: Callable[[], str] | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Validate, queue, and stream the outputs of one request.

        Pieces of the same output that queued up while the caller was sending the last one go
        out as one message: a busy server sends fewer, larger messages instead of falling behind
        (each message costs the event loop the same, whatever it carries).

        `cause` names why the caller went away when this generator is cancelled (the API
        knows: a deadline, a cancel); it goes into the request_aborted log line."""
        tokens = await self._checked_prompt(req)
        adapter = self.adapters.get(req.adapter_id) if req.adapter_id else None
        stream = self._admit(req, tokens, await self._grammar(req), adapter)
        # Every log line of this handler's task carries the request id from here on.
        structlog.contextvars.bind_contextvars(request_id=stream.request_id)
        done = False
        queued: deque[RequestOutput | Exception | None] = deque()
        try:
            while True:
                if not queued:
                    queued.append(await stream.queue.get())
                while not stream.queue.empty():
                    queued.append(stream.queue.get_nowait())
                item = queued.popleft()
                if item is None or isinstance(item, Exception):
                    done = True
                    if item is None:
                        return
                    raise item
                while item.finish_reason is None and queued:
                    later = queued[0]
                    if not isinstance(later, RequestOutput) or later.index != item.index:
                        break
                    item = item.followed_by(later)
                    queued.popleft()
                yield item
        except (asyncio.CancelledError, GeneratorExit):
            # gRPC cancels the handler's task, or closes its generator (at a deadline).
            stream.abort_reason = cause() if cause is not None else "cancelled"
            raise
        finally:
            if not done:
                self._abort(stream)

    async def _grammar(self, req: GenerationRequest) -> Grammar | None:
        """The structured output's matcher, after every cheap refusal (_checked_prompt):
        compiled by the compiler's process (the first compile loads xgrammar: seconds) within
        --grammar-compile-timeout, off the event loop; a cancel ends the compile."""
        spec = req.structured_output
        if spec is None:
            return None
        return await self._grammars.grammar_off_loop(spec, self.limits.request)

    async def _checked_prompt(self, req: GenerationRequest) -> list[int]:
        """The prompt's tokens, once the request passed every check that needs no worker's
        answer (UNAVAILABLE while none is ready or when draining); sizes come first."""
        self._ready_replicas()
        check_fields(req, self.limits)
        tokens = await self.prompt_tokens(req.prompt, req.prompt_token_ids, req.messages)
        check_length(len(tokens), req.max_tokens, self.limits)
        return tokens

    def _ready_replicas(self) -> list[Replica]:
        if self._draining:
            raise Unavailable("the server is shutting down")
        ready = self.replicas
        if not ready:
            raise Unavailable("no ready worker: the service is warming up or its worker is down")
        return ready

    def _admit(
        self, req: GenerationRequest, tokens: list[int], grammar: Grammar | None = None, adapter: Adapter | None = None
    ) -> RequestStream:
        ready = self._ready_replicas()  # again: a drain or a worker loss may begin during a compile
        check_privilege(req)
        request_id = req.request_id or uuid.uuid4().hex
        if self._streams.get(request_id) is not None:
            raise InvalidArgument("request_id", f"{request_id!r} is already in flight")
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        sampling = sampling_options(req, seed, self.limits)
        total = len(tokens) + (req.max_tokens or self.limits.max_model_len - len(tokens))
        target = self._fleet.router.place(
            ready,
            tokens,
            total,
            max(sampling.best_of, sampling.beam_width),
            sampling.beam_width > 1,
            cache_salt=adapter.cache_salt if adapter is not None else 0,
        )
        arrival = next(self._arrivals)
        seq = Sequence(
            seq_id=next(self._fleet.seq_ids),
            request_id=request_id,
            prompt_token_ids=tokens,
            sampling=sampling,
            stopping=stopping_params(req),
            arrival=arrival,
            grammar=grammar,
        )
        group = SequenceGroup(request_id, [seq], sampling, arrival, priority=req.priority, adapter=adapter)
        # The caller's trace ids (bound by the API handler) go on the request's lines that the
        # step loop writes too, which runs in another task.
        trace = {k: v for k, v in structlog.contextvars.get_contextvars().items() if k in TRACE_FIELDS}
        stream = RequestStream(group, self.tokenizer, target.block_bytes, trace=trace, owner=req.owner)
        self._streams.add(stream, target)
        target.post(group)
        self.metrics.prompt_tokens.inc(len(tokens))
        if adapter is not None:
            self.metrics.adapter_requests(adapter.name).inc()
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
            adapter=adapter.name if adapter is not None else None,
        )
        return stream

    async def prompt_tokens(
        self, text: str, token_ids: tuple[int, ...], messages: Messages, limit: str = "max_prompt_bytes"
    ) -> list[int]:
        """The prompt's token ids, from whichever of the three forms was given: a text (or a
        conversation) within RequestLimits `limit`, rendered and tokenized in a thread."""
        if token_ids:
            return list(token_ids)
        request = self.limits.request
        return await prompt_tokens(
            self.tokenizer, self.chat_template, self.spec.public_name, text, messages, request, limit
        )

    def model_info(self) -> ModelInfo:
        return ModelInfo(
            model_name=self.spec.public_name,
            max_model_len=self.limits.max_model_len,
            vocab_size=self.spec.vocab_size,
            eos_token_ids=tuple(sorted(self.spec.eos_token_ids)),
            block_size=self.block_size if self.ready else 0,
            has_chat_template=self.chat_template is not None,
            limits=self.limits,
            max_queue_len=self.config.max_queue_len,
            adapters=tuple(self.adapters.list()),
        )

    # ---- LoRA adapters ----

    def load_adapter(self, name: str, path: str) -> Adapter:
        """Register an adapter (its files checked against the model first, on this thread);
        requests may then name it. Worker groups fetch its weights when a step first needs them.
        For the process's own use (the offline LLM); callers over the network go through
        `load_adapter_at_runtime`."""
        return self._adapter_added(self.adapters.load(name, path))

    async def load_adapter_at_runtime(self, name: str, path: str) -> Adapter:
        """LoadAdapter: only where the operator allowed it (--allow-runtime-lora, which needs
        --lora-root: the registry keeps every path inside it); the files are read off the loop."""
        if self.adapters.enabled and not self.config.allow_runtime_lora:
            raise FailedPrecondition(RUNTIME_LORA_OFF)
        return self._adapter_added(self.adapters.add(await asyncio.to_thread(self.adapters.check, name, path)))

    def _adapter_added(self, adapter: Adapter) -> Adapter:
        log.info(
            "adapter_loaded",
            adapter=adapter.name,
            path=adapter.path,
            version=adapter.version,
            rank=adapter.rank,
            modules=list(adapter.target_modules),
        )
        return adapter

    def unload_adapter(self, name: str) -> Adapter:
        """Forget an adapter: new requests naming it are NOT_FOUND; those in flight keep it. Loaded
        again under the same name it is a new version (its own slot key and prefix-cache salt),
        so requests of the old one never run on the new weights, nor the reverse."""
        adapter = self.adapters.unload(name)
        log.info("adapter_unloaded", adapter=name)
        return adapter

    def load(self) -> Load | None:
        """Queue lengths and KV usage, in all and per worker group; None while none serves."""
        groups = [g for g in (r.load() for r in self.replicas) if g is not None]
        if not groups:
            return None
        return Load(
            sum(g.running for g in groups),
            sum(g.waiting for g in groups),
            sum(g.swapped for g in groups),
            tuple(groups),
        )

    def activity(self) -> list[GroupActivity]:
        """Each serving group's load as a gateway weighs it (see `GroupActivity`)."""
        return [a for a in (r.activity(self.config.max_num_seqs) for r in self.replicas) if a is not None]

    async def flush_prefix_cache(self) -> tuple[int, int]:
        """Forget the cached prefix blocks of every serving group that has none in use.

        Each group flushes at its next step boundary (its loop owns its block manager).
        Returns (blocks forgotten, groups that could not flush because blocks were in use).
        """
        flushes = []
        for replica in self.replicas:
            flush = CacheFlush(asyncio.get_running_loop().create_future())
            replica.post(flush)
            flushes.append(flush.done)
        results = await asyncio.gather(*flushes)
        return sum(r or 0 for r in results), sum(r is None for r in results)

    def abort_requests(self, request_ids: list[str], owner: str | None = None) -> list[str]:
        """Abort in-flight requests by id (their streams end CANCELLED); unknown ids are ignored.

        With `owner`, only that caller's requests: another caller's id is ignored like an
        unknown one, so Abort neither ends nor reveals requests of others. None: any (admins)."""
        aborted = []
        for request_id in dict.fromkeys(request_ids):
            stream = self._streams.get(request_id)
            if stream is not None and not stream.aborted and owner in (None, stream.owner):
                stream.aborted = True
                stream.abort_reason = "abort_call"
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
        replica = self._streams.replica_of(stream)
        if replica is not None and self._fleet.holds(replica):
            replica.post(stream)
        else:
            self._streams.drop(stream)
