"""What a test reads of a running engine's core: the scheduler of its one serving group."""

from __future__ import annotations

from scheduler_svc.engine.engine import Engine
from scheduler_svc.sched.scheduler import Scheduler


def first_scheduler(engine: Engine) -> Scheduler | None:
    """The first serving group's scheduler (the only one with a single worker group)."""
    return next((r.scheduler for r in engine.replicas), None)
