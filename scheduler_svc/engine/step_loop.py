"""One worker group's step loop: the only code that touches its scheduler.

    while True:
        apply queued adds and aborts          (handlers only append to the group's inbox)
        plan = scheduler.schedule(); send it  (and the next ones too, while they can be planned
                                               before this one's result: two in flight, or
                                               one per micro-batch of a pipeline)
        result = await the oldest plan's result
        events = scheduler.update(plan, result)
        detokenize, match stop strings, stream to each request's queue

`Fleet` starts one per connected group (a task per replica) and handles its loss.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import structlog

from common.config import SchedulerConfig
from common.plan import StepPlan
from scheduler_svc.engine.live_streams import LiveStreams
from scheduler_svc.engine.replica import CacheFlush, Replica
from scheduler_svc.engine.step_reporter import StepReporter
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.sequence_group import SequenceGroup
from scheduler_svc.workers.worker_client import PipelinedLink, WorkerLost

log = structlog.get_logger(__name__)


class StepLoop:
    def __init__(
        self,
        config: SchedulerConfig,
        streams: LiveStreams,
        reporter: StepReporter,
        serving: Callable[[], list[Replica]],
    ) -> None:
        self.config = config
        self._streams = streams
        self._reporter = reporter
        self._serving = serving  # the groups serving now, for the fleet-wide gauges

    def _apply_inbox(self, replica: Replica, scheduler: Scheduler) -> None:
        inbox, replica.inbox = replica.inbox, []
        for i, item in enumerate(inbox):
            try:
                if isinstance(item, SequenceGroup):
                    if self._streams.of(item) is not None:
                        scheduler.add(item)
                elif isinstance(item, CacheFlush):
                    item.resolve(scheduler.block_manager.reset_prefix_cache())
                elif self._streams.drop(item):
                    scheduler.abort(item.group.group_id)
                    log.info(
                        "request_aborted",
                        request_id=item.request_id,
                        reason=item.abort_reason or "cancelled",
                        completion_tokens=item.num_output_tokens,
                        **item.trace,
                    )
            except Exception:
                # What was not applied stays queued, so the failure path ends those requests too.
                replica.inbox[:0] = inbox[i:]
                raise

    async def run(self, replica: Replica, scheduler: Scheduler) -> None:
        """Serve `replica` until its worker is lost (WorkerLost) or it deregisters."""
        worker = replica.worker
        # A link that takes a plan before the last result (PipelinedLink) gets the next step as
        # soon as the scheduler can plan it: the worker then goes from one step to the next
        # without waiting for the scheduler, and each stage of a pipeline has a micro-batch of
        # its own. Others run one step at a time.
        pipelined = worker if isinstance(worker, PipelinedLink) else None
        depth = scheduler.max_in_flight if pipelined is not None else 1
        in_flight: deque[tuple[StepPlan, float]] = deque()  # plans sent, and their build seconds
        while True:
            if not replica.attached:
                raise WorkerLost(f"group {replica.name} deregistered")
            replica.wake.clear()
            self._apply_inbox(replica, scheduler)
            self._reporter.publish_gauges(replica, self._serving())
            while len(in_flight) < depth:
                build_start = time.perf_counter()
                plan = scheduler.schedule() if scheduler.has_work else None
                if plan is None:
                    break
                plan_build = time.perf_counter() - build_start
                self._reporter.observe_admissions(scheduler)
                if pipelined is not None:
                    await pipelined.submit(plan)
                in_flight.append((plan, plan_build))
            if not in_flight:
                await replica.wake.wait()
                continue
            plan, plan_build = in_flight.popleft()
            with structlog.contextvars.bound_contextvars(step_id=plan.step_id, group=replica.name):
                if pipelined is not None:
                    result, timing = await pipelined.receive(plan)
                else:
                    result, timing = await worker.execute(plan)
                update_start = time.perf_counter()
                events = scheduler.update(plan, result)
                self._reporter.emit(scheduler, events)
                update = time.perf_counter() - update_start
                # Sampled rows, not events: beam steps sample every beam but emit only at the end.
                self._reporter.record(
                    replica, plan.step_id, plan.num_seqs, plan.num_tokens, int(plan.sample.sum()), timing
                )
                self._reporter.record_parts(result, timing, plan_build, update)
