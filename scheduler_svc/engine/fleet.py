"""The worker groups the engine serves with: connecting to each, its step loop, and recovery.

Each worker group (`Replica`: one worker, or the ranks of a tensor-parallel group) has its own
scheduler and block manager, and a task running its `StepLoop` (`step_loop.py`), the only
code touching them.

A group is lost when its stream breaks, it misses the step deadline, it fails its health
checks, it deregisters, or it sends a result its plan could not have produced (the link
checks every result: common/worker_wire.py `check_result`). Its requests then move with their
tokens to the other groups' queues and are computed again there; with no other group they
fail. Groups come from --worker (redialled when lost) or from registration (`attach_group` /
`detach_group`).

What a group reports at the handshake is checked before anything is sized by it: numbers in
bounds (common/worker_info.py), the model's vocabulary, the scheduler's block size, and, for
a registered group, a context no shorter than the one the serving groups already allow
requests (a group that joins may not lower every other group's limit). A registered group
that fails is refused through its registration, which ends its ranks' Register calls with
the reason.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable

import structlog

from common.config import SchedulerConfig
from common.errors import Aborted, Unavailable
from common.model_spec import ModelSpec
from common.worker_info import WorkerInfo, out_of_bounds
from scheduler_svc.engine.live_streams import LiveStreams
from scheduler_svc.engine.metrics import SchedulerMetrics
from scheduler_svc.engine.replica import Replica
from scheduler_svc.engine.request import Limits
from scheduler_svc.engine.request_stream import RequestStream
from scheduler_svc.engine.router import Router
from scheduler_svc.engine.step_loop import StepLoop
from scheduler_svc.engine.step_reporter import StepReporter
from scheduler_svc.kv.block_manager import BlockManager
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.sequence_group import SequenceGroup
from scheduler_svc.workers.worker_client import WorkerLink, WorkerLost, WorkerRefused

log = structlog.get_logger(__name__)


class Fleet:
    def __init__(
        self,
        spec: ModelSpec,
        config: SchedulerConfig,
        streams: LiveStreams,
        metrics: SchedulerMetrics,
        workers: list[WorkerLink],
        worker_factory: Callable[[list[str]], WorkerLink] | None,
        on_ready: Callable[[bool], Awaitable[None]] | None,
        connect_timeout: float,
    ) -> None:
        self.spec = spec
        self.config = config
        # The engine's live requests by id; a request that ends or fails leaves it.
        self._streams = streams
        self.metrics = metrics
        # Fixed worker groups (--worker), or none: then registered groups serve (see attach_group).
        self._static = workers
        self._worker_factory = worker_factory
        # Every worker group known, connected or not, by name.
        self._replicas: dict[str, Replica] = {}
        self.router = Router(config)
        self._step_loop = StepLoop(config, streams, StepReporter(metrics, streams), lambda: self.serving)
        self._on_ready = on_ready
        self._ready_reported: bool | None = None
        # Several group loops report readiness; one at a time, so health's two entries agree.
        self._ready_lock = asyncio.Lock()
        self._connect_timeout = connect_timeout
        # Request limits follow the serving groups' context lengths.
        self.limits = Limits.of(spec, config)
        # One id space for every group's scheduler, so a request can move between them.
        self.seq_ids = itertools.count()
        self._stopping = False

    @property
    def serving(self) -> list[Replica]:
        """The worker groups that are connected and serving."""
        return [r for r in self._replicas.values() if r.ready]

    @property
    def ready(self) -> bool:
        return any(r.ready for r in self._replicas.values())

    @property
    def block_size(self) -> int:
        """The KV block size every group must use: configured, else the serving groups' (0: any)."""
        return self.config.block_size or next((r.serving_scheduler.block_manager.block_size for r in self.serving), 0)

    def holds(self, replica: Replica) -> bool:
        """Whether `replica` is the live group of its name (not one torn down or replaced)."""
        return self._replicas.get(replica.name) is replica

    def start(self) -> None:
        for worker in self._static:
            self._add_replica(worker.address, worker)

    async def stop(self) -> None:
        """End every group's loop and close its link (the engine has ended the requests)."""
        # Registration answers until the server stops, which is after this: a group completing
        # from now on must not start a loop that nothing would stop.
        self._stopping = True
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

    def attach_group(self, name: str, addresses: list[str], refuse: Callable[[str], None] | None = None) -> None:
        """A registered group has all its ranks: connect to it and serve with it. `refuse(reason)`
        ends its registration, when its handshake rules it out."""
        if self._stopping:
            return
        if self._worker_factory is None or self._static:
            if refuse is not None:
                refuse("this scheduler serves only its --worker addresses")
            return
        current = self._replicas.get(name)
        # A group that deregistered may still be tearing down under this name: the new
        # registration replaces it (its teardown leaves a newer replica of the name alone).
        if current is not None and current.attached:
            if refuse is not None:
                refuse(f"a worker group named {name!r} is serving")
            return
        self._add_replica(name, self._worker_factory(addresses), refuse)

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

    def _add_replica(self, name: str, worker: WorkerLink, refuse: Callable[[str], None] | None = None) -> None:
        replica = Replica(name, worker)
        self._replicas[name] = replica
        replica.task = asyncio.create_task(self._run(replica, refuse), name=f"engine:{name}")

    async def _run(self, replica: Replica, refuse: Callable[[str], None] | None) -> None:
        """Connect to the group and serve with it until it is lost; a --worker one is retried."""
        try:
            while replica.attached:
                try:
                    await self._serve(replica, refuse)
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
            if self.holds(replica):
                del self._replicas[replica.name]
            # However the task ended, nothing may stay queued on a group that no longer runs.
            if replica.scheduler is not None or replica.inbox:
                self._recover(replica)
            await replica.worker.close()
            await self._refresh_ready()

    async def _serve(self, replica: Replica, refuse: Callable[[str], None] | None) -> None:
        worker = replica.worker
        try:
            info = await worker.connect(self._connect_timeout)
        except WorkerRefused as error:
            await self._refuse(replica, str(error), refuse)
            return
        except WorkerLost as error:
            # Each attempt waits connect_timeout for the channel; then say so and try again.
            log.warning(
                "worker_unreachable", group=replica.name, address=worker.address, reason=str(error), retrying=True
            )
            return
        problem = self._incompatibility(replica, info)
        if problem:
            await self._refuse(replica, problem, refuse)
            return
        replica.info = info
        replica.reported = (0, 0, 0, 0, 0)
        replica.scheduler = Scheduler(
            self.config,
            BlockManager(
                info.num_gpu_blocks,
                info.block_size,
                num_host_blocks=info.num_cpu_blocks,
                enable_prefix_caching=self.config.enable_prefix_caching,
            ),
            max_model_len=min(self.spec.max_model_len, info.max_model_len),
            eos_token_ids=self.spec.eos_token_ids,
            block_bytes=info.block_bytes,
            seq_ids=self.seq_ids,
            num_lora_slots=info.max_loras if self.config.enable_lora else 0,
            pipeline_stages=info.pipeline_stages,
            # CPU ranks share one host's cores (a group's ranks are started together).
            stages_share_cores=info.device == "cpu",
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
            lora_slots=info.max_loras,
            pipeline_stages=info.pipeline_stages,
            micro_batches=replica.scheduler.micro_batches,
        )
        await self._refresh_ready()
        try:
            await self._step_loop.run(replica, replica.scheduler)
        except WorkerLost as error:
            log.error("worker_lost", group=replica.name, address=worker.address, reason=str(error))
            self._recover(replica)

    async def _refuse(self, replica: Replica, problem: str, refuse: Callable[[str], None] | None) -> None:
        log.error("worker_refused", group=replica.name, address=replica.worker.address, reason=problem)
        await replica.worker.close()
        # A registered group that cannot serve this model is dropped, its registration ended
        # with the reason; a --worker is retried.
        if not self._static:
            replica.attached = False
            if refuse is not None:
                refuse(problem)
        else:
            await asyncio.sleep(4.0)

    def _recover(self, lost: Replica) -> None:
        """Move the lost group's requests, with their tokens, to the other groups' queues.

        They are computed again there from their prompt and output so far; streams continue
        where they were, since tokens are only appended once a step's result arrives and
        sampling depends only on (seed, position). Without another group they fail.
        """
        groups, aborts = lost.evacuate()
        self._drop_aborted(aborts)
        targets = [r for r in self.serving if r is not lost]
        moved = failed = 0
        for group in groups:
            stream = self._streams.of(group)
            if stream is None:
                continue
            target = self.router.place_moved(targets, group)
            if target is None:
                self._fail_stream(group, "the worker was lost")
                failed += 1
                continue
            self._streams.move(stream, target)
            target.post(group)
            moved += 1
        self.metrics.recovered.inc(moved)
        if moved or failed:
            log.warning("requests_recovered", group=lost.name, moved=moved, failed=failed, to=[t.name for t in targets])

    def _fail_stream(self, group: SequenceGroup, what: str) -> None:
        """End a request that lost its worker: ABORTED if it streamed tokens, else UNAVAILABLE."""
        stream = self._streams.drop_group(group)
        if stream is None:
            return
        # best_of > n and beams send nothing before the end: their client may simply retry.
        n = stream.num_output_tokens if group.streams else 0
        stream.fail(
            Aborted(f"{what} after {n} tokens were streamed") if n else Unavailable(f"{what}; retry the request")
        )

    def _drop_aborted(self, aborts: list[RequestStream]) -> None:
        for stream in aborts:
            self._streams.drop(stream)

    async def _refresh_ready(self) -> None:
        """Tell health whether any group serves; limits follow the groups that do."""
        ready = self.serving
        if ready:
            self.limits = Limits.of(self.spec, self.config, min(r.serving_scheduler.max_model_len for r in ready))
        else:
            # Nothing runs or waits any more and no KV is held: say so, rather than leaving the
            # gauges at their last values until a worker is back.
            for gauge in (
                self.metrics.running,
                self.metrics.waiting,
                self.metrics.swapped,
                self.metrics.kv_usage,
                self.metrics.cpu_usage,
            ):
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

    def _incompatibility(self, replica: Replica, info: WorkerInfo) -> str | None:
        """Why the group `replica` cannot serve with what it reported, or None."""
        problem = out_of_bounds(info)
        if problem:
            return problem
        if info.model_name != self.spec.name:
            return f"worker serves model {info.model_name!r}, this scheduler serves {self.spec.name!r}"
        if info.vocab_size != self.spec.vocab_size:
            return f"worker vocabulary has {info.vocab_size} tokens, the model's config says {self.spec.vocab_size}"
        addresses = len(replica.worker.address.split(","))
        if info.world_size != addresses:
            return f"worker is one of a group of {info.world_size} ranks, {addresses} addresses were given"
        # Above the model's own limit is clamped (the scheduler never plans past it). Requests
        # are bounded by the shortest context serving: a registered group below the one the
        # serving groups set would shrink every request's room, so it is refused. The --worker
        # list is the operator's, whose groups' contexts may differ (the shortest sets the limit).
        context = min(self.spec.max_model_len, info.max_model_len)
        others = [r.serving_scheduler.max_model_len for r in self.serving if r is not replica]
        established = min(others, default=context)
        if not self._static and context < established:
            return (
                f"worker allows sequences of {context} tokens, the serving groups {established}: "
                "a group may not lower the limit requests already have"
            )
        if self.block_size and info.block_size != self.block_size:
            return f"worker uses KV blocks of {info.block_size} tokens, this scheduler {self.block_size}; start it with --block-size {self.block_size}"
        if self.config.enable_lora and not info.max_loras:
            return "worker has no LoRA adapter slots and this scheduler serves adapters; start it with --enable-lora"
        if self.config.enable_lora and info.max_lora_rank < self.config.max_lora_rank:
            return (
                f"worker's LoRA slots hold rank {info.max_lora_rank}, this scheduler accepts adapters up to rank "
                f"{self.config.max_lora_rank}; start it with --max-lora-rank {self.config.max_lora_rank}"
            )
        speculative = self.config.speculative
        if speculative is not None and speculative.method == "draft" and not info.draft_model:
            return "worker has no draft model and this scheduler drafts with one; start it with --speculative-model DIR"
        return None
