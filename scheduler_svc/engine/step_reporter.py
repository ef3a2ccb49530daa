"""What a step's result turns into outside the scheduler: stream messages, metrics, logs.

Called by each worker group's loop after `Scheduler.update`; it holds no scheduling state,
only the engine's map of live request streams (a finished request leaves it here).
"""

from __future__ import annotations

import time

import structlog

from common.errors import Aborted
from common.plan import StepResult
from scheduler_svc.engine.live_streams import LiveStreams
from scheduler_svc.engine.metrics import SchedulerMetrics
from scheduler_svc.engine.replica import Replica
from scheduler_svc.engine.request_stream import RequestStream
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.sequence import FinishReason
from scheduler_svc.sched.token_events import TokenEvent
from scheduler_svc.workers.worker_client import StepTiming

log = structlog.get_logger(__name__)


class StepReporter:
    def __init__(self, metrics: SchedulerMetrics, streams: LiveStreams) -> None:
        self.metrics = metrics
        self.streams = streams

    def emit(self, scheduler: Scheduler, events: list[TokenEvent]) -> None:
        touched: dict[str, RequestStream] = {}
        by_adapter: dict[str, int] = {}
        now = time.monotonic()
        for event in events:
            group = event.group
            stream = self.streams.of(group)
            if stream is None:
                continue
            if event.token_id >= 0:
                stream.on_token(event, scheduler)
                if stream.first_token_time is None:
                    stream.first_token_time = now
                    self.metrics.ttft.observe(now - stream.arrival_time)
                elif stream.last_token_time is not None and stream.last_token_time < now:
                    self.metrics.itl.observe(now - stream.last_token_time)
                stream.last_token_time = now
                if stream.group.adapter is not None:
                    name = stream.group.adapter.name
                    by_adapter[name] = by_adapter.get(name, 0) + 1
            elif event.finish_reason is FinishReason.ABORTED and not group.is_beam:
                # A structured output the worker sampled past (Scheduler._apply), or one whose
                # masks grew too slow for a step (its grammar says so: RESOURCE_EXHAUSTED).
                failure = event.seq.grammar.failure if event.seq.grammar is not None else None
                stream.fail(
                    failure or Aborted("the structured output's grammar allows no token the model can sample here")
                )
            touched[stream.request_id] = stream
        for name, tokens in by_adapter.items():
            self.metrics.adapter_tokens(name).inc(tokens)
        # Only after every event of the step: a stop string on one sample can end the group
        # while a sibling's last token of the same step is still to be sent.
        for stream in touched.values():
            if stream.group.is_finished:
                self._close(stream)

    def _close(self, stream: RequestStream) -> None:
        stream.finish()
        self.streams.drop(stream)
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
            spec_drafted=stats.spec_draft_tokens,
            spec_accepted=stats.spec_accepted_tokens,
            **stream.trace,
        )

    def observe_admissions(self, scheduler: Scheduler) -> None:
        now = time.monotonic()
        for group in scheduler.queues.admitted:
            stream = self.streams.of(group)
            if stream is not None and not stream.scheduled:
                stream.scheduled = True
                self.metrics.queue_time.observe(now - stream.arrival_time)

    def publish_gauges(self, replica: Replica, serving: list[Replica]) -> None:
        """This group's gauges, and the service-wide ones summed over every serving group."""
        m = self.metrics
        loads = []
        for r in serving:
            load = r.load()
            if load is not None:
                loads.append(load)
                if r is replica:
                    m.group(r.name).set(load)
        m.running.set(sum(g.running for g in loads))
        m.waiting.set(sum(g.waiting for g in loads))
        m.swapped.set(sum(g.swapped for g in loads))
        blocks, cpu_blocks = sum(g.num_gpu_blocks for g in loads), sum(g.num_cpu_blocks for g in loads)
        m.kv_usage.set(1 - sum(g.free_gpu_blocks for g in loads) / blocks if blocks else 0.0)
        m.cpu_usage.set(1 - sum(g.free_cpu_blocks for g in loads) / cpu_blocks if cpu_blocks else 0.0)

    def record_parts(self, result: StepResult, timing: StepTiming, plan_build: float, update: float) -> None:
        """Where the step's time went: the scheduler's parts, and the worker's when it sent them.

        transport is the round trip less what the worker reports of its own time (all of its
        execute time, plus decoding the plan and encoding the result when it profiles)."""
        worker = result.part_seconds
        busy = timing.execute_seconds + worker.get("plan_decode", 0.0) + worker.get("result_encode", 0.0)
        parts = {
            "plan_build": plan_build,
            "plan_encode": timing.encode_seconds,
            "transport": max(timing.roundtrip_seconds - busy, 0.0),
            "result_decode": timing.decode_seconds,
            "update": update,
            **worker,
        }
        self.metrics.steps.inc()
        self.metrics.add_step_parts(parts)
        log.debug("step_parts", **{f"{name}_ms": round(seconds * 1e3, 3) for name, seconds in parts.items()})

    def record(
        self, replica: Replica, step_id: int, num_seqs: int, num_tokens: int, num_sampled: int, timing: StepTiming
    ) -> None:
        m = self.metrics
        m.plan_bytes.observe(timing.plan_bytes)
        m.roundtrip.observe(timing.roundtrip_seconds)
        m.generation_tokens.inc(num_sampled)
        sched = replica.scheduler
        if sched is not None:
            # The scheduler keeps plain counters (it is pure); publish what moved since last step.
            now = (
                sched.queues.num_preemptions,
                sched.queues.prefix_queried_tokens,
                sched.queues.prefix_hit_tokens,
                sched.num_planned_ahead,
                sched.num_adapter_loads,
            )
            for counter, new, old in zip(
                (m.preemptions, m.prefix_queries, m.prefix_hits, m.planned_ahead, m.adapter_loads),
                now,
                replica.reported,
            ):
                if new > old:
                    counter.inc(new - old)
            replica.reported = now
            drafter = sched.drafter
            if drafter is not None and drafter.drafted_total < replica.reported_drafts[0]:
                replica.reported_drafts = (0, 0)  # a new scheduler for a reconnected group counts from 0
            if drafter is not None and drafter.drafted_total > replica.reported_drafts[0]:
                drafted, accepted = replica.reported_drafts
                m.speculation(
                    drafter.config.method,
                    drafter.drafted_total - drafted,
                    drafter.accepted_total - accepted,
                    drafter.accepted_total / drafter.drafted_total,
                )
                replica.reported_drafts = (drafter.drafted_total, drafter.accepted_total)
        log.debug(
            "step",
            step_id=step_id,
            num_seqs=num_seqs,
            num_tokens=num_tokens,
            plan_bytes=timing.plan_bytes,
            roundtrip_ms=round(timing.roundtrip_seconds * 1e3, 3),
            execute_ms=round(timing.execute_seconds * 1e3, 3),
        )
        replica.stats.add(num_tokens, num_sampled, timing)
        replica.speed.observe(num_tokens, timing.roundtrip_seconds)
        if replica.stats.due() and sched is not None:
            log.info("engine_stats", group=replica.name, **replica.stats.summary(sched))
            replica.stats.reset()
