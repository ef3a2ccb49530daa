"""Running totals for the periodic `engine_stats` log line (one line per interval, not per step)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.workers.worker_client import StepTiming

INTERVAL_S = 10.0


@dataclass
class EngineStats:
    started: float = field(default_factory=time.monotonic)
    steps: int = 0
    tokens: int = 0
    sampled: int = 0
    plan_bytes: int = 0
    roundtrip: float = 0.0

    def add(self, num_tokens: int, num_sampled: int, timing: StepTiming) -> None:
        if self.steps == 0:  # rates cover busy time, not the idle wait before the first step
            self.started = time.monotonic() - timing.roundtrip_seconds
        self.steps += 1
        self.tokens += num_tokens
        self.sampled += num_sampled
        self.plan_bytes += timing.plan_bytes
        self.roundtrip += timing.roundtrip_seconds

    def output_rate(self) -> float:
        """Tokens sampled per second over the current interval (0 before its first step)."""
        if not self.steps:
            return 0.0
        return self.sampled / max(time.monotonic() - self.started, 1e-9)

    def due(self) -> bool:
        return self.steps > 0 and time.monotonic() - self.started >= INTERVAL_S

    def summary(self, scheduler: Scheduler) -> dict[str, float | int]:
        seconds = max(time.monotonic() - self.started, 1e-9)
        steps = max(self.steps, 1)
        return {
            "steps": self.steps,
            "input_tokens_per_s": round(self.tokens / seconds, 1),
            "output_tokens_per_s": round(self.sampled / seconds, 1),
            "mean_plan_bytes": self.plan_bytes // steps,
            "mean_roundtrip_ms": round(self.roundtrip / steps * 1e3, 3),
            "running": scheduler.num_running,
            "waiting": scheduler.num_waiting,
            "kv_used_blocks": scheduler.block_manager.num_used_blocks,
        }

    def reset(self) -> None:
        self.steps = self.tokens = self.sampled = self.plan_bytes = 0
        self.roundtrip = 0.0
