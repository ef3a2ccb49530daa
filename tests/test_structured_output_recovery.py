"""Structured outputs survive a lost worker group: a worker is killed (SIGKILL) while its
constrained requests stream, they move to the other group and are recomputed there, and each
output still parses and validates with `jsonschema`.

The matcher lives with the sequence (scheduler_svc/text/grammar.py), so a moved sequence resumes
from where its grammar stood: a matcher started over, or one that missed or repeated a token,
would turn the streamed text into something no schema accepts. The random-weight model writes
nothing valid on its own, so every valid output is the grammar's doing.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import jsonschema

from common.pb.llmserve.v1 import generation_pb2 as pb
from scheduler_svc.sched.sequence import FinishReason, Sequence
from tests.conftest import Scheduler, collect
from tests.test_scale_out import Worker, recovered, replica, two_groups  # noqa: F401 (fixture)
from tests.test_structured_output import SCHEMAS, constrained

# Long enough (50-150 tokens) that a request seen running with a few tokens cannot finish in
# the step or two that may still be applied after the kill: these are surely moved.
LONG: dict[str, object] = {
    "type": "array",
    "items": {"type": "integer", "minimum": 100, "maximum": 999},
    "minItems": 16,
    "maxItems": 16,
}
LONG_RUNS = [(0.0, 0)] * 2 + [(1.0, seed) for seed in range(1, 7)]
LONG_MAX_TOKENS = 400  # what tells a long request's sequence apart (the others have 160)


def cases() -> list[tuple[dict[str, object], float, int, int]]:
    """(schema, temperature, seed, max_tokens): every schema once, greedy and sampled
    alternately, and the long ones."""
    runs = [(schema, 0.0 if i % 2 == 0 else 1.0, i, 160) for i, schema in enumerate(SCHEMAS)]
    return runs + [(LONG, t, seed, LONG_MAX_TOKENS) for t, seed in LONG_RUNS]


def requests() -> list[pb.GenerateRequest]:
    return [
        constrained(pb.StructuredOutput(json_schema=json.dumps(schema)), t, seed, max_tokens=m)
        for schema, t, seed, m in cases()
    ]


def is_long(q: Sequence) -> bool:
    return q.token_limit - q.num_prompt_tokens == LONG_MAX_TOKENS


async def constrained_mid_stream(s: Scheduler, w: Worker, timeout: float = 30.0) -> list[Sequence]:
    """Until the worker's group runs a long constrained request that has streamed tokens
    (polled tightly, bounded); then its constrained sequences that have streamed some."""
    deadline = time.monotonic() + timeout
    while True:
        sched = replica(s, w.address).scheduler
        running = [g.seqs[0] for g in sched.queues.running] if sched is not None else []
        if any(q.grammar is not None and is_long(q) and q.num_output_tokens >= 3 for q in running):
            return [q for q in running if q.grammar is not None and q.num_output_tokens >= 1]
        assert time.monotonic() < deadline, "the group never ran a long constrained request"
        await asyncio.sleep(0.002)


async def test_constrained_outputs_stay_valid_after_their_worker_is_killed_mid_stream(
    two_groups: tuple[Scheduler, list[Worker]],
) -> None:
    s, workers = two_groups
    reqs, runs = requests(), cases()
    # Undisturbed first: it compiles every grammar (the first loads xgrammar, seconds), so the
    # disturbed run's timing is the workers' alone; and greedy outputs must come out the same.
    undisturbed = await asyncio.wait_for(asyncio.gather(*(collect(s.stub, r) for r in reqs)), timeout=60)
    assert all(r.scheduler.next_step_id > 0 for r in s.engine.replicas)  # both groups served
    before = recovered(s)

    tasks = [asyncio.create_task(collect(s.stub, r)) for r in reqs]
    victim = workers[0]
    moving = await constrained_mid_stream(s, victim)
    # No await between the look and the kill: the engine loop, on this event loop, cannot
    # apply another step in between.
    at_kill = {q.seq_id: (q.grammar, q.num_output_tokens) for q in moving}
    victim.proc.send_signal(signal.SIGKILL)
    disturbed = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)

    assert [r.name for r in s.engine.replicas] == [workers[1].address]
    for (schema, t, seed, _), got, calm in zip(runs, disturbed, undisturbed):
        assert got.final.finish_reason == pb.FINISH_REASON_STOP, (schema, t, seed, got.text)
        jsonschema.validate(json.loads(got.text), schema)
        if t == 0.0:
            assert got.token_ids == calm.token_ids, (schema, got.text, calm.text)
    # The long ones caught mid-stream finished elsewhere, past where they stood, each with the
    # matcher it had (moved with the sequence, not made anew).
    long_moved = [q for q in moving if is_long(q) and at_kill[q.seq_id][1] >= 3]
    assert recovered(s) - before >= len(long_moved) >= 1, "no constrained request moved"
    for q in moving:
        grammar, streamed = at_kill[q.seq_id]
        assert q.grammar is grammar and q.finish_reason is FinishReason.STOP
        assert q.num_output_tokens >= streamed
    for q in long_moved:
        assert q.num_output_tokens > at_kill[q.seq_id][1]
    await s.wait_idle()
