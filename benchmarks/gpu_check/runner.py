"""Runs the sections in order under one time budget, recording each as ok, failed or skipped.

A device run is rarely repeated and its window is short, so the runner never lets one
section cost another: a section starts only when its estimate fits in what is left of the
budget, one that raises is recorded with its error while the rest still run, and the report
is saved after every section, so that a run killed from outside loses only the section it
was in. A section that runs on past the end of the budget is interrupted (SIGALRM), which
keeps the whole run inside the window it was given.
"""

from __future__ import annotations

import importlib
import math
import os
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from gpu_check.context import Context, Skip
from gpu_check.report import Report

# Names of sections to make raise at their start (comma-separated): how the tests check that
# a failing section is recorded and does not stop the others. Not for use on a device run.
FAIL_ENV = "GPU_CHECK_FAIL"


@dataclass(frozen=True)
class Section:
    """One measured part of the check. `target` ("module:function" in this package, or the
    function itself) is imported only when the section runs, so a module that cannot be
    imported (an optional dependency missing on the device) fails its own section only."""

    name: str
    what: str
    cold_s: float  # estimated seconds on an H200 whose Triton cache is empty
    warm_s: float  # the same with the kernels already compiled
    target: str | Callable[[Context], dict[str, Any]]
    takes_rest: bool = False  # runs with whatever budget is left (the kernel tests)

    def estimate(self, warm: bool) -> float:
        return self.warm_s if warm else self.cold_s

    def load(self) -> Callable[[Context], dict[str, Any]]:
        if callable(self.target):
            return self.target
        module, _, function = self.target.partition(":")
        fn: Callable[[Context], dict[str, Any]] = getattr(importlib.import_module(f"gpu_check.{module}"), function)
        return fn


class Budget:
    """Seconds left of the run's budget (infinite without one), on a clock tests can replace."""

    def __init__(self, total_s: float | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.total_s = total_s
        self.clock = clock
        self.start = clock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def left(self) -> float:
        return math.inf if self.total_s is None else self.total_s - self.elapsed()


class SectionTimeout(Exception):
    """The budget ran out while the section was still running."""


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise SectionTimeout in the main thread once `seconds` pass (no limit when infinite).
    GPU work returns to Python between launches, so the interrupt lands within a kernel's time;
    a subprocess the section waits on is killed by the section's own clean-up."""
    if math.isinf(seconds) or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise SectionTimeout(f"still running when the budget ran out ({seconds:.0f} s were left)")

    previous = signal.signal(signal.SIGALRM, expire)
    start = time.monotonic()
    pending, _ = signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if pending:  # someone else's alarm (pytest-timeout's): re-armed for what was left of it
            signal.setitimer(signal.ITIMER_REAL, max(pending - (time.monotonic() - start), 0.001))


def plan(sections: list[Section], budget_s: float | None) -> list[dict[str, Any]]:
    """What a run would do if every section took exactly its estimate, cold and warm: printed
    before every run, so that a person sees which sections a budget reaches (a dry run shows
    it for a device run without one)."""
    rows = [{"section": s.name, "cold_s": s.cold_s, "warm_s": s.warm_s} for s in sections]
    for warmth in ("cold", "warm"):
        left = math.inf if budget_s is None else budget_s
        for s, row in zip(sections, rows):
            estimate = s.estimate(warmth == "warm")
            if estimate > left:
                row[warmth] = f"skip ({estimate:.0f} s > {left:.0f} s left)"
            elif s.takes_rest:
                row[warmth] = "run" if math.isinf(left) else f"run in the {left:.0f} s left"
            else:
                row[warmth] = "run"
                left -= estimate
    return rows


def failures_requested() -> set[str]:
    return {name.strip() for name in os.environ.get(FAIL_ENV, "").split(",") if name.strip()}


def run_sections(
    sections: list[Section],
    ctx: Context,
    report: Report,
    warm: bool,
    after_each: Callable[[], None] = lambda: None,
) -> None:
    """Each section in order into `report` (saved after each). In a dry run every section's
    set-up is walked whatever the budget: that is what a dry run checks."""
    fail = failures_requested()
    for s in sections:
        estimate = s.estimate(warm)
        left = ctx.budget.left()
        if not ctx.dry and estimate > left:
            report.skipped(s.name, estimate, f"estimate {estimate:.0f} s > {left:.0f} s left of the budget")
            report.save()
            continue
        print(f"-- {s.name}: {s.what} (estimate {estimate:.0f} s)", flush=True)
        start = ctx.budget.clock()
        try:
            with deadline(math.inf if ctx.dry else left):
                if s.name in fail:
                    raise RuntimeError(f"failure injected through {FAIL_ENV}")
                result = s.load()(ctx)
        except Skip as reason:
            report.skipped(s.name, estimate, str(reason), ctx.budget.clock() - start)
        except Exception as error:  # noqa: BLE001 - every failure is recorded, none stops the run
            report.failed(s.name, estimate, error, traceback.format_exc(), ctx.budget.clock() - start)
        else:
            report.ok(s.name, estimate, result, ctx.budget.clock() - start)
        entry = report.sections[s.name]
        print(f"   {s.name}: {entry['status']} in {entry['seconds']:.1f} s  {entry.get('summary', '')}", flush=True)
        report.save()
        after_each()
