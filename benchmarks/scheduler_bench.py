"""The scheduler's CPU cost per step, against a fake worker: no model, no process, no network.

A fake worker answers every plan at once with tokens that are a pure function of the sequence
and position, so the only work timed is the scheduler's own, per step:

    schedule  Scheduler.schedule(): choosing the step, then build_plan (also reported alone)
    encode    common.worker_wire.encode_plan(plan).SerializeToString()
    decode    worker_pb2.StepResult.FromString + common.worker_wire.decode_result
              (the worker's bytes are made, by common.worker_wire.encode_result, outside the clock)
    update    Scheduler.update(plan, result)

Times are CPU time of this process (time.process_time_ns), so other load on the machine does
not inflate them. Two runs, one workload seed:

    mixed        --requests requests (prompts of 1,000-4,000 random tokens, 32-128 output
                 tokens, ignore_eos) through --max-running slots, prefill chunks and decodes
                 in the same steps. Requests arrive to keep --backlog of them waiting (the
                 engine refuses more than max_queue_len, 1024 by default). Reported over all
                 steps and over the steps of at least 97.5 % of --max-running sequences.
    pure decode  --max-running sequences of 1,000-4,000 tokens, all decoding: nothing is
                 admitted or finishes while the clock runs. The target, under 1 ms per step,
                 is about this one.

    python benchmarks/scheduler_bench.py
    python benchmarks/scheduler_bench.py --quick --requests 200 --profile

Both runs end by checking the scheduler's and block manager's integrity and that every block
is free again. The result JSON goes to benchmarks/results/scheduler_bench.json (--out).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime as dt
import importlib.metadata
import io
import json
import math
import os
import platform
import pstats
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import structlog

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make the packages importable without install
    sys.path.insert(0, str(REPO_ROOT))

from common import log as logsetup  # noqa: E402
from common import worker_wire  # noqa: E402
from common.config import SchedulerConfig  # noqa: E402
from common.pb.llmserve.v1 import worker_pb2 as worker_pb  # noqa: E402
from common.plan import StepPlan, StepResult  # noqa: E402
from scheduler_svc.kv.block_manager import BlockManager  # noqa: E402
from scheduler_svc.sched.plan_builder import PlanBuilder  # noqa: E402
from scheduler_svc.sched.scheduler import Scheduler  # noqa: E402
from scheduler_svc.sched.sequence import (  # noqa: E402
    FinishReason,
    SamplingOptions,
    Sequence,
    StoppingParams,
)
from scheduler_svc.sched.sequence_group import SequenceGroup  # noqa: E402
from scheduler_svc.sched.token_events import TokenEvent  # noqa: E402

log = structlog.get_logger("benchmark")

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "scheduler_bench.json"

# Workload bounds (inclusive).
PROMPT_LEN = (1000, 4000)
OUTPUT_LEN = (32, 128)
VOCAB_SIZE = 49152  # SmolLM2's
MIN_TOKEN_ID = 100  # below: special tokens; a random prompt must hold no end-of-sequence marker
EOS_TOKEN_IDS = frozenset({0, 2})
BLOCK_SIZE = 16
# Blocks per slot beyond the longest sequence: the pool never preempts, so the run measures the
# decode-dominated steady state rather than swapping.
SPARE_BLOCKS_PER_SLOT = 8
# KV bytes of one block of a SmolLM2-135M-sized model (30 layers, 3 KV heads x 64, bf16): only
# weighs swap against recompute, which this pool never needs.
BLOCK_BYTES = 2 * 30 * 3 * 64 * 2 * BLOCK_SIZE
TARGET_US = 1000.0
STEADY_FRACTION = 0.975
PURE_DECODE_WARMUP_STEPS = 20
QUICK_DECODE_STEPS = 50
QUICK_REQUESTS = 500

PHASES = ("schedule", "build_plan", "encode", "decode", "update")


# ---- workload ----


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int


def requests(
    num: int, seed: int, prompt_len: tuple[int, int] = PROMPT_LEN, output_len: tuple[int, int] = OUTPUT_LEN
) -> Iterator[Request]:
    """The workload, made lazily (10,000 prompts of ~2.5k ids would hold ~1 GiB of ints).

    A pure function of its arguments: the same seed gives the same requests in the same order.
    """
    rng = np.random.default_rng(seed)
    for _ in range(num):
        n = int(rng.integers(prompt_len[0], prompt_len[1], endpoint=True))
        m = int(rng.integers(output_len[0], output_len[1], endpoint=True))
        yield Request(rng.integers(MIN_TOKEN_ID, VOCAB_SIZE, size=n).tolist(), m)


def make_group(sched: Scheduler, index: int, request: Request) -> SequenceGroup:
    request_id = f"bench-{index}"
    seq = Sequence(
        seq_id=sched.queues.new_seq_id(),
        request_id=request_id,
        prompt_token_ids=request.prompt,
        sampling=SamplingOptions(seed=index),
        stopping=StoppingParams(max_tokens=request.max_tokens, ignore_eos=True),
        arrival=index,
    )
    return SequenceGroup(request_id, [seq], seq.sampling, arrival=index)


def make_scheduler(args: argparse.Namespace, max_tokens: int) -> Scheduler:
    """A pool of `max_running` slots of the longest sequence, plus spare: no preemption."""
    blocks_per_slot = -(-(PROMPT_LEN[1] + max_tokens) // BLOCK_SIZE) + SPARE_BLOCKS_PER_SLOT
    num_blocks = args.max_running * blocks_per_slot
    config = SchedulerConfig(max_num_seqs=args.max_running, max_num_batched_tokens=args.max_num_batched_tokens)
    bm = BlockManager(num_blocks, BLOCK_SIZE, num_host_blocks=num_blocks // 4, enable_prefix_caching=True)
    return Scheduler(
        config, bm, max_model_len=PROMPT_LEN[1] + max_tokens + 1, eos_token_ids=EOS_TOKEN_IDS, block_bytes=BLOCK_BYTES
    )


# ---- the fake worker ----


def fake_token(seq_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The token a sequence 'samples' at a position: a hash of both, never below MIN_TOKEN_ID."""
    mixed = (seq_ids.astype(np.int64) * 7919 + positions.astype(np.int64) * 104729) % (VOCAB_SIZE - MIN_TOKEN_ID)
    return mixed + MIN_TOKEN_ID


def fake_worker(plan_bytes: bytes) -> bytes:
    """Decode and check the plan as a worker would, answer at once, encode the result."""
    plan = worker_wire.decode_plan(worker_pb.StepPlan.FromString(plan_bytes))
    plan.validate()
    sample = plan.sample.astype(bool)
    # The sampled token takes the position right after the tokens fed: context + query.
    tokens = fake_token(plan.seq_ids, plan.context_lens + plan.query_lens)
    result = StepResult(
        step_id=plan.step_id,
        sampled_token_ids=np.where(sample, tokens, -1).astype(np.int32),
        logprobs=np.where(sample, -1.0, np.nan).astype(np.float32),
    )
    return worker_wire.encode_result(result).SerializeToString()


# ---- one timed step ----


@dataclass
class StepTimes:
    """Per-step samples, in nanoseconds of process CPU time (and plan sizes)."""

    ns: dict[str, list[int]] = field(default_factory=lambda: {p: [] for p in PHASES})
    num_seqs: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    plan_bytes: list[int] = field(default_factory=list)
    result_bytes: list[int] = field(default_factory=list)

    def total_ns(self) -> np.ndarray:
        # build_plan runs inside schedule: not added twice.
        parts = [np.array(self.ns[p], dtype=np.int64) for p in ("schedule", "encode", "decode", "update")]
        return np.sum(parts, axis=0)


class BuildTimer:
    """Times plan building inside schedule() by wrapping PlanBuilder.build."""

    def __init__(self) -> None:
        self.ns = 0

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        original = PlanBuilder.build

        def timed(*a: Any, **kw: Any) -> StepPlan:
            start = time.process_time_ns()
            try:
                return original(*a, **kw)
            finally:
                self.ns += time.process_time_ns() - start

        PlanBuilder.build = timed  # type: ignore[method-assign]
        try:
            yield
        finally:
            PlanBuilder.build = original  # type: ignore[method-assign]


def timed_step(sched: Scheduler, times: StepTimes, build: BuildTimer) -> tuple[StepPlan, list[TokenEvent]] | None:
    clock = time.process_time_ns
    build.ns = 0
    t0 = clock()
    plan = sched.schedule()
    t1 = clock()
    if plan is None:
        return None
    plan_bytes = worker_wire.encode_plan(plan).SerializeToString()
    t2 = clock()
    result_bytes = fake_worker(plan_bytes)  # the worker's side: not the scheduler's time
    t3 = clock()
    result = worker_wire.decode_result(worker_pb.StepResult.FromString(result_bytes), plan.num_seqs)
    t4 = clock()
    events = sched.update(plan, result)
    t5 = clock()
    for phase, ns in zip(PHASES, (t1 - t0, build.ns, t2 - t1, t4 - t3, t5 - t4), strict=True):
        times.ns[phase].append(ns)
    times.num_seqs.append(plan.num_seqs)
    times.num_tokens.append(plan.num_tokens)
    times.plan_bytes.append(len(plan_bytes))
    times.result_bytes.append(len(result_bytes))
    return plan, events


def timer_overhead_us() -> float:
    """CPU time the clock reads inside one step's timed intervals cost (about 6), in microseconds."""
    n = 20000
    start = time.process_time_ns()
    for _ in range(n):
        time.process_time_ns()
    return (time.process_time_ns() - start) / n * 6 / 1000


# ---- reporting ----


def _us(values: np.ndarray) -> dict[str, float]:
    us = values.astype(np.float64) / 1000
    return {
        "mean": float(us.mean()),
        "p50": float(np.percentile(us, 50)),
        "p99": float(np.percentile(us, 99)),
        "max": float(us.max()),
    }


def summarize(times: StepTimes, mask: np.ndarray | None = None) -> dict[str, Any]:
    """Per-step statistics of the steps in `mask` (all by default); only a zero count if none."""
    n = len(times.num_seqs)
    keep = np.ones(n, dtype=bool) if mask is None else mask
    if not keep.any():
        return {"steps": 0}
    out: dict[str, Any] = {"steps": int(keep.sum()), "total_us": _us(times.total_ns()[keep])}
    for phase in PHASES:
        out[f"{phase}_us"] = _us(np.array(times.ns[phase], dtype=np.int64)[keep])
    for name in ("num_seqs", "num_tokens", "plan_bytes", "result_bytes"):
        out[f"{name}_mean"] = float(np.array(getattr(times, name))[keep].mean())
    return out


def integrity(sched: Scheduler) -> dict[str, Any]:
    """Whether the run left nothing behind: integrity checks pass and every block is free."""
    bm = sched.block_manager
    report: dict[str, Any] = {
        "num_blocks": bm.num_blocks,
        "free_blocks": bm.num_free_blocks,
        "cached_blocks": bm.device.num_cached,
        "host_blocks": bm.host.num_blocks,
        "host_free_blocks": bm.host.num_free,
        "error": None,
    }
    try:
        sched.check_integrity()
        if sched.has_work:
            raise AssertionError(f"{len(sched.queues.groups)} groups still scheduled")
        if bm.num_free_blocks != bm.num_blocks or bm.host.num_free != bm.host.num_blocks:
            raise AssertionError("blocks are still in use")
    except AssertionError as e:
        report["error"] = str(e)
    report["all_free"] = bm.num_free_blocks == bm.num_blocks and bm.host.num_free == bm.host.num_blocks
    report["ok"] = report["error"] is None
    return report


class TokenCheck:
    """Counts the run's tokens and checks each is the one the fake worker sent."""

    def __init__(self) -> None:
        self.tokens = 0
        self.finished = 0
        self.wrong: list[str] = []

    def add(self, events: list[TokenEvent]) -> None:
        for ev in events:
            seq = ev.seq
            self.tokens += 1
            want = int(fake_token(np.array([seq.seq_id]), np.array([seq.num_tokens - 1]))[0])
            if ev.token_id != want and len(self.wrong) < 10:
                self.wrong.append(f"seq {seq.seq_id}: token {ev.token_id}, sent {want}")
            if ev.group_finished:
                self.finished += 1
                max_tokens = seq.stopping.max_tokens
                if ev.finish_reason is not FinishReason.LENGTH or seq.num_output_tokens != max_tokens:
                    self.wrong.append(
                        f"seq {seq.seq_id} ended by {ev.finish_reason} after {seq.num_output_tokens}/{max_tokens}"
                    )


# ---- the two runs ----


def run_mixed(args: argparse.Namespace) -> dict[str, Any]:
    sched = make_scheduler(args, OUTPUT_LEN[1])
    workload = requests(args.requests, args.seed)
    times, build, check = StepTimes(), BuildTimer(), TokenCheck()
    running: list[int] = []
    added = prompt_tokens = expected_tokens = 0
    start = time.perf_counter()
    with build.installed():
        while True:
            # Arrivals, outside the clock: keep the backlog an engine would allow waiting.
            while sched.num_waiting < args.backlog and added < args.requests:
                request = next(workload)
                sched.add(make_group(sched, added, request))
                added += 1
                prompt_tokens += len(request.prompt)
                expected_tokens += request.max_tokens
            if not sched.has_work:
                break
            running.append(sched.num_running)
            step = timed_step(sched, times, build)
            if step is None:
                raise RuntimeError(
                    f"schedule() returned no plan with {sched.num_waiting} waiting, {sched.num_running} running"
                )
            check.add(step[1])
            n = len(times.num_seqs)
            if n % args.log_every == 0:
                recent = times.total_ns()[-args.log_every :]
                log.info(
                    "progress",
                    run="mixed",
                    step=n,
                    finished=check.finished,
                    total=args.requests,
                    running=sched.num_running,
                    waiting=sched.num_waiting,
                    recent_mean_us=round(float(recent.mean()) / 1000, 1),
                    elapsed_s=round(time.perf_counter() - start, 1),
                )
    wall = time.perf_counter() - start
    steady = np.array(times.num_seqs) >= math.ceil(STEADY_FRACTION * args.max_running)
    log.info("run_done", run="mixed", steps=len(times.num_seqs), steady_steps=int(steady.sum()), wall_s=round(wall, 1))
    return {
        "requests": args.requests,
        "finished_requests": check.finished,
        "all_finished": check.finished == args.requests,
        "prompt_tokens": prompt_tokens,
        "output_tokens": check.tokens,
        "expected_output_tokens": expected_tokens,
        "token_errors": check.wrong,
        "wall_s": wall,
        "num_running_mean": float(np.mean(running)),
        "steady_min_seqs": math.ceil(STEADY_FRACTION * args.max_running),
        "all_steps": summarize(times),
        "steady_steps": summarize(times, steady),
        "integrity": integrity(sched),
    }


def _fill_for_decode(sched: Scheduler, prompts: list[list[int]], max_tokens: int) -> None:
    """Admit the prompts and run (untimed) until all of them are running and decoding."""
    for i, prompt in enumerate(prompts):
        sched.add(make_group(sched, i, Request(prompt, max_tokens)))
    for _ in range(max_tokens):
        plan = sched.schedule()
        if plan is None:
            raise RuntimeError("nothing to run while filling")
        result_bytes = fake_worker(worker_wire.encode_plan(plan).SerializeToString())
        sched.update(plan, worker_wire.decode_result(worker_pb.StepResult.FromString(result_bytes), plan.num_seqs))
        if sched.num_running == len(prompts) and all(
            s.num_tokens - s.num_computed_tokens == 1 for g in sched.queues.running for s in g.seqs
        ):
            return
    raise RuntimeError("the sequences did not all reach decoding")


def _decode_loop(args: argparse.Namespace, sched: Scheduler, steps: int, times: StepTimes, build: BuildTimer) -> None:
    for _ in range(steps):
        step = timed_step(sched, times, build)
        if step is None:
            raise RuntimeError("no plan in the pure decode run")
        plan, events = step
        if (
            plan.num_seqs != args.max_running
            or plan.num_tokens != args.max_running
            or any(e.finish_reason for e in events)
        ):
            raise RuntimeError(f"step {plan.step_id} is not a pure decode step of {args.max_running} sequences")


def run_pure_decode(args: argparse.Namespace) -> tuple[dict[str, Any], str | None]:
    """Time decode steps of --max-running sequences; returns the summary and the cProfile text."""
    profile_steps = args.decode_steps if args.profile else 0
    # The first prompts admitted decode while the others prefill, for at most this many steps.
    fill_steps = -(-args.max_running * PROMPT_LEN[1] // (args.max_num_batched_tokens - args.max_running + 1)) + 16
    # Prompts short enough that no sequence outgrows PROMPT_LEN before the last timed step;
    # outputs long enough that none finishes before the last (profiled) step.
    timed_tokens = fill_steps + PURE_DECODE_WARMUP_STEPS + args.decode_steps + 4
    prompt_len = (PROMPT_LEN[0], max(PROMPT_LEN[0], PROMPT_LEN[1] - timed_tokens))
    prompts = [r.prompt for r in requests(args.max_running, args.seed + 1, prompt_len)]
    max_tokens = timed_tokens + profile_steps
    sched = make_scheduler(args, max_tokens)
    _fill_for_decode(sched, prompts, max_tokens)
    times, build = StepTimes(), BuildTimer()
    with build.installed():
        _decode_loop(args, sched, PURE_DECODE_WARMUP_STEPS, StepTimes(), build)
        _decode_loop(args, sched, args.decode_steps, times, build)
    context = [s.num_tokens for g in sched.queues.running for s in g.seqs]  # after the last timed step
    profile_text = None
    if args.profile:
        # A second loop, apart from the timed one: the profiler would inflate its numbers.
        profiler = cProfile.Profile()
        profiler.enable()
        _decode_loop(args, sched, profile_steps, StepTimes(), BuildTimer())
        profiler.disable()
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out).sort_stats("cumulative")
        stats.print_stats(r"scheduler_svc", 20)
        profile_text = out.getvalue()
    sched.abort_all()
    summary = summarize(times)
    log.info("run_done", run="pure_decode", steps=args.decode_steps, mean_us=round(summary["total_us"]["mean"], 1))
    return {
        "num_seqs": args.max_running,
        "prompt_len": list(prompt_len),
        "context_tokens_min": int(np.min(context)),
        "context_tokens_mean": float(np.mean(context)),
        "context_tokens_max": int(np.max(context)),
        **summary,
        "integrity": integrity(sched),
    }, profile_text


# ---- flags, machine, main ----


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--requests",
        type=_positive_int,
        default=None,
        help=f"requests in the mixed run (default 10000, --quick {QUICK_REQUESTS})",
    )
    p.add_argument("--max-running", type=_positive_int, default=256, help="max_num_seqs (default 256)")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=8192, help="token budget (default 8192)")
    p.add_argument(
        "--backlog",
        type=_positive_int,
        default=SchedulerConfig().max_queue_len,
        help="requests kept waiting in the mixed run (default: max_queue_len, 1024)",
    )
    p.add_argument(
        "--decode-steps",
        type=_positive_int,
        default=None,
        help=f"timed steps of the pure decode run (default 1000, --quick {QUICK_DECODE_STEPS})",
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--quick", action="store_true", help="a small run for tests: fewer requests and decode steps")
    p.add_argument("--profile", action="store_true", help="also print a cProfile of pure decode steps")
    p.add_argument("--log-every", type=_positive_int, default=500, help="steps between progress lines (default 500)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"result JSON (default {DEFAULT_OUT})")
    args = p.parse_args(argv)
    if args.requests is None:
        args.requests = QUICK_REQUESTS if args.quick else 10_000
    if args.decode_steps is None:
        args.decode_steps = QUICK_DECODE_STEPS if args.quick else 1000
    if args.max_num_batched_tokens < args.max_running:
        p.error("--max-num-batched-tokens must be at least --max-running, or no step decodes them all")
    return args


def _cpu_model() -> str | None:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return None


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "protobuf": importlib.metadata.version("protobuf"),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logsetup.configure()
    log.info(
        "benchmark_phase",
        phase="mixed",
        requests=args.requests,
        max_running=args.max_running,
        budget=args.max_num_batched_tokens,
        seed=args.seed,
    )
    mixed = run_mixed(args)
    log.info("benchmark_phase", phase="pure_decode", num_seqs=args.max_running, steps=args.decode_steps)
    pure, profile_text = run_pure_decode(args)
    met = pure["total_us"]["mean"] < TARGET_US
    valid = (
        mixed["all_finished"]
        and mixed["output_tokens"] == mixed["expected_output_tokens"]
        and not mixed["token_errors"]
        and mixed["integrity"]["ok"]
        and pure["integrity"]["ok"]
    )
    result = {
        "benchmark": "scheduler",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": machine(),
        "config": {
            "requests": args.requests,
            "max_running": args.max_running,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "backlog": args.backlog,
            "block_size": BLOCK_SIZE,
            "prompt_len": list(PROMPT_LEN),
            "output_len": list(OUTPUT_LEN),
            "decode_steps": args.decode_steps,
            "seed": args.seed,
            "quick": args.quick,
            "prefix_caching": True,
        },
        "timer": {"clock": "process_time_ns", "overhead_us_per_step": timer_overhead_us()},
        "mixed": mixed,
        "pure_decode": pure,
        "target_us": TARGET_US,
        "target_met": met,
        "valid": valid,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    log.info("result_written", path=str(args.out))
    _print_table(mixed, pure)
    if profile_text is not None:
        print(profile_text)
    print(
        f"target <1 ms/step: {'met' if met else 'missed'} "
        f"(pure decode of {args.max_running} seqs: mean {pure['total_us']['mean']:.0f} us/step)"
    )
    if not valid:
        print(
            "INVALID RUN: unfinished requests, wrong tokens or a failed integrity check; see the JSON", file=sys.stderr
        )
        return 1
    return 0


def _print_table(mixed: dict[str, Any], pure: dict[str, Any]) -> None:
    rows = [("mixed, all steps", mixed["all_steps"]), ("mixed, steady", mixed["steady_steps"]), ("pure decode", pure)]
    print(
        f"{'us per step':<18}{'steps':>7}{'seqs':>6}{'total':>8}{'p50':>8}{'p99':>8}"
        f"{'sched':>8}{'build':>8}{'encode':>8}{'decode':>8}{'update':>8}{'plan KiB':>10}"
    )
    for name, s in rows:
        if not s.get("steps"):
            print(f"{name:<18}{0:>7}")
            continue
        print(
            f"{name:<18}{s['steps']:>7}{s['num_seqs_mean']:>6.0f}{s['total_us']['mean']:>8.0f}"
            f"{s['total_us']['p50']:>8.0f}{s['total_us']['p99']:>8.0f}"
            + "".join(f"{s[f'{p}_us']['mean']:>8.0f}" for p in PHASES)
            + f"{s['plan_bytes_mean'] / 1024:>10.1f}"
        )


if __name__ == "__main__":
    sys.exit(main())
