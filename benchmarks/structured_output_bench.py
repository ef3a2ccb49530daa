"""What structured outputs cost the scheduler per step, against a fake worker: no model, no
process, no network.

N sequences, all decoding, run twice with the same prompts, seeds and step count:

    unconstrained  as scheduler_bench's pure decode run
    constrained    every sequence constrained by one JSON schema, an array of exactly 200 small
                   objects ({"id": 0-999, "ok": boolean}), compiled by xgrammar against
                   SmolLM2's tokenizer: thousands of tokens, so no output ends while timed

The fake worker decodes the plan, and for a constrained row answers with an allowed token of
its mask row (the k-th allowed one, k a hash of the sequence and position: different rows stand
in different places of the grammar, as sampled outputs do); other rows get scheduler_bench's
token. Timed per step, as scheduler_bench does, in CPU time of this process
(time.process_time_ns) and in wall time (perf_counter_ns):

    schedule    Scheduler.schedule(): choosing the step, then build_plan (also reported alone),
                whose mask fill (grammar.fill_masks: xgrammar's threads fill the rows) is
                reported alone too
    encode      common.worker_wire.encode_plan(plan).SerializeToString()
    decode      worker_pb2.StepResult.FromString + common.worker_wire.decode_result
    update      Scheduler.update(plan, result): for a constrained row, accept_token and the
                grammar's end check

A constrained sequence is never planned ahead (its next mask depends on the token in flight),
so all of this lies between a step's result and the next plan: what it costs the worker per
step is the wall-time total. CPU time counts xgrammar's threads too, so for the mask fill it
may exceed the wall time.

    python benchmarks/structured_output_bench.py
    python benchmarks/structured_output_bench.py --quick --num-seqs 16,32

Each run ends with the integrity check and every block free; the result JSON goes to
benchmarks/results/structured_output_bench.json (--out).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.metadata
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import structlog
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make the packages importable without install
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.scheduler_bench import (  # noqa: E402
    BLOCK_SIZE,
    PROMPT_LEN,
    PURE_DECODE_WARMUP_STEPS,
    VOCAB_SIZE,
    Request,
    _positive_int,
    _us,
    fake_token,
    integrity,
    machine,
    make_group,
    make_scheduler,
    requests,
    timer_overhead_us,
)
from common import log as logsetup  # noqa: E402
from common import worker_wire  # noqa: E402
from common.config import SchedulerConfig  # noqa: E402
from common.model_spec import ModelSpec  # noqa: E402
from common.pb.llmserve.v1 import worker_pb2 as worker_pb  # noqa: E402
from common.plan import StepPlan, StepResult  # noqa: E402
from scheduler_svc.sched import plan_builder  # noqa: E402
from scheduler_svc.sched.plan_builder import PlanBuilder  # noqa: E402
from scheduler_svc.sched.scheduler import Scheduler  # noqa: E402
from scheduler_svc.sched.token_events import TokenEvent  # noqa: E402
from scheduler_svc.text.grammar import GrammarCompiler  # noqa: E402
from scheduler_svc.text.structured_output import StructuredOutput  # noqa: E402

log = structlog.get_logger("benchmark")

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "structured_output_bench.json"

ITEMS = 200
SCHEMA: dict[str, object] = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}},
        "required": ["id", "ok"],
        "additionalProperties": False,
    },
    # Exactly 200: with fewer allowed, "]" would soon be drawn and the outputs would end.
    "minItems": ITEMS,
    "maxItems": ITEMS,
}
DEFAULT_NUM_SEQS = (64, 256)
DEFAULT_STEPS = 1000
QUICK_STEPS = 20
QUICK_WARMUP_STEPS = 5
MAX_NUM_BATCHED_TOKENS = 8192

PHASES = ("schedule", "build_plan", "fill_masks", "encode", "decode", "update")
TOTAL_OF = ("schedule", "encode", "decode", "update")  # the others run inside schedule


# ---- the fake worker ----


def allowed_token(mask_row: np.ndarray, seq_id: int, position: int) -> tuple[int, int]:
    """(token, number allowed): the k-th token the packed mask row allows, k a hash of the
    sequence and position."""
    bits = np.unpackbits(mask_row.view(np.uint8), bitorder="little")[:VOCAB_SIZE]
    allowed = np.flatnonzero(bits)
    if allowed.size == 0:
        raise RuntimeError(f"seq {seq_id}: the mask allows no token at position {position}")
    k = int(fake_token(np.array([seq_id]), np.array([position]))[0])
    return int(allowed[k % allowed.size]), int(allowed.size)


@dataclass
class FakeWorker:
    """Decodes and checks the plan as a worker would, answers with allowed tokens."""

    constrained_rows: list[int] = field(default_factory=list)  # per step
    allowed: list[int] = field(default_factory=list)  # per constrained row answered

    def __call__(self, plan_bytes: bytes) -> bytes:
        plan = worker_wire.decode_plan(worker_pb.StepPlan.FromString(plan_bytes))
        plan.validate()
        sample = plan.sample.astype(bool)
        positions = plan.context_lens + plan.query_lens  # the sampled token's position
        tokens = fake_token(plan.seq_ids, positions)
        rows, masks = plan.sampling.mask_rows, plan.sampling.token_masks
        constrained = np.flatnonzero(rows >= 0) if rows.size else np.zeros(0, np.int64)
        for i in constrained.tolist():
            tokens[i], n = allowed_token(masks[rows[i]], int(plan.seq_ids[i]), int(positions[i]))
            self.allowed.append(n)
        self.constrained_rows.append(int(constrained.size))
        result = StepResult(
            step_id=plan.step_id,
            sampled_token_ids=np.where(sample, tokens, -1).astype(np.int32),
            logprobs=np.where(sample, -1.0, np.nan).astype(np.float32),
        )
        return worker_wire.encode_result(result).SerializeToString()


# ---- timing ----


@dataclass
class StepTimes:
    """Per-step samples in nanoseconds, CPU and wall, and the plan's size."""

    cpu: dict[str, list[int]] = field(default_factory=lambda: {p: [] for p in PHASES})
    wall: dict[str, list[int]] = field(default_factory=lambda: {p: [] for p in PHASES})
    num_seqs: list[int] = field(default_factory=list)
    plan_bytes: list[int] = field(default_factory=list)
    result_bytes: list[int] = field(default_factory=list)

    def total(self, clock: str) -> np.ndarray:
        samples = getattr(self, clock)
        return np.sum([np.array(samples[p], dtype=np.int64) for p in TOTAL_OF], axis=0)


class Inner:
    """Times the calls to one function inside schedule() (both clocks) by wrapping it."""

    def __init__(self, owner: Any, name: str) -> None:
        self.owner, self.name = owner, name
        self.cpu = self.wall = 0

    def reset(self) -> None:
        self.cpu = self.wall = 0

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        original: Callable[..., Any] = getattr(self.owner, self.name)

        def timed(*a: Any, **kw: Any) -> Any:
            c, w = time.process_time_ns(), time.perf_counter_ns()
            try:
                return original(*a, **kw)
            finally:
                self.cpu += time.process_time_ns() - c
                self.wall += time.perf_counter_ns() - w

        setattr(self.owner, self.name, timed)
        try:
            yield
        finally:
            setattr(self.owner, self.name, original)


@dataclass
class Timers:
    build: Inner = field(default_factory=lambda: Inner(PlanBuilder, "build"))
    # plan_builder imported the function by name: its module's binding is the one called.
    fill: Inner = field(default_factory=lambda: Inner(plan_builder, "fill_masks"))

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        with self.build.installed(), self.fill.installed():
            yield


def timed_step(
    sched: Scheduler, worker: FakeWorker, times: StepTimes, timers: Timers
) -> tuple[StepPlan, list[TokenEvent]] | None:
    cpu, wall = time.process_time_ns, time.perf_counter_ns
    timers.build.reset()
    timers.fill.reset()
    c0, w0 = cpu(), wall()
    plan = sched.schedule()
    c1, w1 = cpu(), wall()
    if plan is None:
        return None
    plan_bytes = worker_wire.encode_plan(plan).SerializeToString()
    c2, w2 = cpu(), wall()
    result_bytes = worker(plan_bytes)  # the worker's side: not the scheduler's time
    c3, w3 = cpu(), wall()
    result = worker_wire.decode_result(worker_pb.StepResult.FromString(result_bytes), plan.num_seqs)
    c4, w4 = cpu(), wall()
    events = sched.update(plan, result)
    c5, w5 = cpu(), wall()
    b, f = timers.build, timers.fill
    for phase, c, w in zip(
        PHASES,
        (c1 - c0, b.cpu, f.cpu, c2 - c1, c4 - c3, c5 - c4),
        (w1 - w0, b.wall, f.wall, w2 - w1, w4 - w3, w5 - w4),
        strict=True,
    ):
        times.cpu[phase].append(c)
        times.wall[phase].append(w)
    times.num_seqs.append(plan.num_seqs)
    times.plan_bytes.append(len(plan_bytes))
    times.result_bytes.append(len(result_bytes))
    return plan, events


# ---- one run ----


def summarize(times: StepTimes) -> dict[str, Any]:
    out: dict[str, Any] = {"steps": len(times.num_seqs)}
    for clock in ("cpu", "wall"):
        samples = getattr(times, clock)
        out[clock] = {"total_us": _us(times.total(clock))} | {
            f"{p}_us": _us(np.array(samples[p], dtype=np.int64)) for p in PHASES
        }
    for name in ("num_seqs", "plan_bytes", "result_bytes"):
        out[f"{name}_mean"] = float(np.mean(getattr(times, name)))
    return out


def _step(sched: Scheduler, worker: FakeWorker) -> list[TokenEvent]:
    plan = sched.schedule()
    if plan is None:
        raise RuntimeError("nothing to run while filling")
    result_bytes = worker(worker_wire.encode_plan(plan).SerializeToString())
    return sched.update(plan, worker_wire.decode_result(worker_pb.StepResult.FromString(result_bytes), plan.num_seqs))


def _check_decode_step(step: tuple[StepPlan, list[TokenEvent]] | None, n: int, constrained: bool) -> None:
    if step is None:
        raise RuntimeError("no plan in a decode run")
    plan, events = step
    ended = [e for e in events if e.finish_reason]
    if plan.num_seqs != n or plan.num_tokens != n or ended:
        reason = ended[0].finish_reason if ended else None
        raise RuntimeError(f"step {plan.step_id} is not a decode step of {n} sequences (one ended: {reason})")
    masked = int((plan.sampling.mask_rows >= 0).sum()) if plan.sampling.mask_rows.size else 0
    if masked != (n if constrained else 0):
        raise RuntimeError(f"step {plan.step_id} masks {masked} rows of {n}")


def run(
    n: int, steps: int, warmup: int, seed: int, compiler: GrammarCompiler | None, position: int, total: int
) -> dict[str, Any]:
    """Time `steps` decode steps of n sequences (constrained when a compiler is given)."""
    budget = MAX_NUM_BATCHED_TOKENS
    # The first prompts admitted decode while the others prefill, for at most this many steps.
    fill_steps = -(-n * PROMPT_LEN[1] // (budget - n + 1)) + 16
    timed_tokens = fill_steps + warmup + steps + 4
    prompt_len = (PROMPT_LEN[0], max(PROMPT_LEN[0], PROMPT_LEN[1] - timed_tokens))
    prompts = [r.prompt for r in requests(n, seed + 1, prompt_len)]
    sched = make_scheduler(SimpleNamespace(max_running=n, max_num_batched_tokens=budget), timed_tokens)
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    for i, prompt in enumerate(prompts):
        group = make_group(sched, i, Request(prompt, timed_tokens))
        if compiler is not None:
            group.seqs[0].grammar = compiler.grammar(spec)
        sched.add(group)
    worker = FakeWorker()
    for _ in range(timed_tokens):  # untimed: until all of them run and decode
        if any(e.finish_reason for e in _step(sched, worker)):
            raise RuntimeError("a sequence ended while filling")
        if sched.num_running == n and all(
            s.num_tokens - s.num_computed_tokens == 1 for g in sched.queues.running for s in g.seqs
        ):
            break
    else:
        raise RuntimeError("the sequences did not all reach decoding")
    label = f"{'constrained' if compiler is not None else 'unconstrained'}, {n} seqs ({position}/{total})"
    times, timers = StepTimes(), Timers()
    with timers.installed():
        for _ in range(warmup):
            _check_decode_step(timed_step(sched, worker, StepTimes(), timers), n, compiler is not None)
        worker.allowed.clear()
        for _ in tqdm(range(steps), desc=label, unit="step", file=sys.stderr, leave=False):
            _check_decode_step(timed_step(sched, worker, times, timers), n, compiler is not None)
    outputs = [s.num_output_tokens for g in sched.queues.running for s in g.seqs]
    sched.abort_all()
    summary = summarize(times)
    log.info(
        "run_done",
        constrained=compiler is not None,
        num_seqs=n,
        steps=steps,
        wall_us=round(summary["wall"]["total_us"]["mean"], 1),
        cpu_us=round(summary["cpu"]["total_us"]["mean"], 1),
    )
    return {
        **summary,
        "output_tokens_at_end_min": int(np.min(outputs)),
        "output_tokens_at_end_max": int(np.max(outputs)),
        "allowed_tokens_per_row_mean": float(np.mean(worker.allowed)) if worker.allowed else 0.0,
        "integrity": integrity(sched),
    }


def overhead(plain: dict[str, Any], constrained: dict[str, Any], n: int) -> dict[str, Any]:
    """Constrained minus unconstrained, mean per step, both clocks."""
    out: dict[str, Any] = {}
    for clock in ("cpu", "wall"):
        a, b = plain[clock], constrained[clock]
        delta = {
            f"{p}_us": b[f"{p}_us"]["mean"] - a[f"{p}_us"]["mean"]
            for p in ("total", "schedule", "encode", "decode", "update")
        }
        delta["fill_masks_us"] = b["fill_masks_us"]["mean"]
        delta["total_per_seq_us"] = delta["total_us"] / n
        delta["ratio"] = b["total_us"]["mean"] / a["total_us"]["mean"]
        out[clock] = delta
    out["plan_bytes"] = constrained["plan_bytes_mean"] - plain["plan_bytes_mean"]
    return out


# ---- flags, main ----


def _num_seqs(text: str) -> list[int]:
    try:
        values = [_positive_int(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"a comma-separated list of positive integers, got {text!r}") from e
    if not values:
        raise argparse.ArgumentTypeError("no sequence counts")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--num-seqs",
        type=_num_seqs,
        default=list(DEFAULT_NUM_SEQS),
        help="running sequences, comma-separated (default 64,256)",
    )
    p.add_argument(
        "--steps",
        type=_positive_int,
        default=None,
        help=f"timed decode steps per run (default {DEFAULT_STEPS}, --quick {QUICK_STEPS})",
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--quick", action="store_true", help="a small run for tests: fewer steps")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"result JSON (default {DEFAULT_OUT})")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = QUICK_STEPS if args.quick else DEFAULT_STEPS
    if max(args.num_seqs) >= MAX_NUM_BATCHED_TOKENS:
        p.error(f"--num-seqs must stay below the token budget, {MAX_NUM_BATCHED_TOKENS}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logsetup.configure()
    from llmserve.cli.configs import cache_root
    from llmserve.model_prep import prepare_default_model

    model_dir = prepare_default_model(cache_root())
    spec = ModelSpec.from_dir(model_dir)
    if spec.vocab_size != VOCAB_SIZE:
        raise RuntimeError(f"the fake worker's vocabulary is {VOCAB_SIZE}, the model's {spec.vocab_size}")
    compiler = GrammarCompiler(
        str(model_dir), spec.vocab_size, spec.eos_token_ids, SchedulerConfig().json_max_whitespace
    )
    started = time.perf_counter()
    compiler.compile(StructuredOutput("json_schema", json.dumps(SCHEMA)))  # loads xgrammar: outside every run
    log.info("grammar_compiled", seconds=round(time.perf_counter() - started, 2))
    warmup = QUICK_WARMUP_STEPS if args.quick else PURE_DECODE_WARMUP_STEPS
    runs: list[dict[str, Any]] = []
    total = 2 * len(args.num_seqs)
    for k, n in enumerate(args.num_seqs):
        plain = run(n, args.steps, warmup, args.seed, None, 2 * k + 1, total)
        constrained = run(n, args.steps, warmup, args.seed, compiler, 2 * k + 2, total)
        runs.append(
            {
                "num_seqs": n,
                "unconstrained": plain,
                "constrained": constrained,
                "overhead": overhead(plain, constrained, n),
            }
        )
    valid = all(r[kind]["integrity"]["ok"] for r in runs for kind in ("unconstrained", "constrained"))
    result = {
        "benchmark": "structured_output",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": machine() | {"xgrammar": importlib.metadata.version("xgrammar")},
        "config": {
            "num_seqs": args.num_seqs,
            "steps": args.steps,
            "warmup_steps": warmup,
            "seed": args.seed,
            "quick": args.quick,
            "block_size": BLOCK_SIZE,
            "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
            "prompt_len_max": PROMPT_LEN[1],
            "model": spec.name,
            "vocab_size": spec.vocab_size,
            "json_max_whitespace": SchedulerConfig().json_max_whitespace,
            "schema": SCHEMA,
        },
        "timer": {"clocks": ["process_time_ns", "perf_counter_ns"], "overhead_us_per_step": timer_overhead_us()},
        "runs": runs,
        "valid": valid,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    log.info("result_written", path=str(args.out))
    _print_table(runs)
    if not valid:
        print("INVALID RUN: a failed integrity check; see the JSON", file=sys.stderr)
        return 1
    return 0


def _print_table(runs: list[dict[str, Any]]) -> None:
    cols = ("total", "schedule", "build_plan", "fill_masks", "encode", "decode", "update")
    for clock, title in (("wall", "wall time"), ("cpu", "CPU time")):
        print(f"us per step, mean ({title})")
        print(f"{'run':<22}{'steps':>7}" + "".join(f"{c:>11}" for c in cols) + f"{'plan KiB':>10}")
        for r in runs:
            for kind in ("unconstrained", "constrained"):
                s = r[kind]
                print(
                    f"{kind + ', ' + str(r['num_seqs']):<22}{s['steps']:>7}"
                    + "".join(f"{s[clock][f'{c}_us']['mean']:>11.0f}" for c in cols)
                    + f"{s['plan_bytes_mean'] / 1024:>10.1f}"
                )
            o = r["overhead"][clock]
            print(
                f"{'  overhead':<22}{'':>7}{o['total_us']:>+11.0f}{o['schedule_us']:>+11.0f}{'':>11}"
                f"{o['fill_masks_us']:>+11.0f}{o['encode_us']:>+11.0f}{o['decode_us']:>+11.0f}{o['update_us']:>+11.0f}"
                f"{r['overhead']['plan_bytes'] / 1024:>+10.1f}"
                f"   ({o['ratio']:.2f}x, {o['total_per_seq_us']:.1f} us per constrained sequence)"
            )
        print()


if __name__ == "__main__":
    sys.exit(main())
