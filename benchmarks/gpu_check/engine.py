"""Our engine in one process: the worker's ModelRunner driven by our Scheduler, the same two
objects the services wrap, without gRPC between them (what is measured is the step).

Every request is submitted at once and decoded greedily with ignore_eos, so a run's tokens
are a pure function of the weights and prompts, and the time to each request's first token
counts from the start of the run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpu_check.context import Context


def build_runner(ctx: Context, model_dir: str, dtype: str, **worker: Any) -> Any:
    """A ModelRunner on the run's device with the Triton backend (the interpreter on a CPU);
    `worker` overrides WorkerConfig fields, `cache` a dict of CacheConfig fields."""
    from common.config import CacheConfig, WorkerConfig
    from worker_svc.step.runner import ModelRunner

    cache = {"num_gpu_blocks": 512, "num_cpu_blocks": 0, **worker.pop("cache", {})}
    config = WorkerConfig(
        model=model_dir,
        dtype=dtype,
        device=str(ctx.device),
        attention_backend="triton",
        cache=CacheConfig(**cache),
        **worker,
    )
    return ModelRunner(config)


@dataclass
class Run:
    outputs: list[list[int]]
    seconds: float
    steps: int
    first_token_s: list[float] = field(default_factory=list)  # per request, from the start

    @property
    def output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    def stats(self) -> dict[str, Any]:
        ttft = np.array(self.first_token_s) if self.first_token_s else np.zeros(1)
        return {
            "requests": len(self.outputs),
            "output_tokens": self.output_tokens,
            "steps": self.steps,
            "seconds": self.seconds,
            "output_tokens_per_s": self.output_tokens / self.seconds if self.seconds else None,
            "ttft_median_s": float(np.median(ttft)),
            "ttft_p90_s": float(np.percentile(ttft, 90)),
            "ttft_max_s": float(ttft.max()),
        }


def run_requests(runner: Any, requests: list[tuple[list[int], int]], max_num_batched_tokens: int = 2048) -> Run:
    """(prompt token ids, max new tokens) each, greedily, through the scheduler's steps."""
    from common.config import SchedulerConfig
    from scheduler_svc.kv.block_manager import BlockManager
    from scheduler_svc.sched.scheduler import Scheduler
    from scheduler_svc.sched.sequence import SamplingOptions, Sequence, StoppingParams
    from scheduler_svc.sched.sequence_group import SequenceGroup

    config = SchedulerConfig(max_num_seqs=runner.config.max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    sched = Scheduler(config, BlockManager(runner.kv.num_blocks, runner.block_size), runner.max_model_len, frozenset())
    seqs = [
        Sequence(
            i,
            str(i),
            list(prompt),
            SamplingOptions(),
            StoppingParams(max_tokens=max_tokens, ignore_eos=True),
            arrival=i,
        )
        for i, (prompt, max_tokens) in enumerate(requests)
    ]
    for s in seqs:
        sched.add(SequenceGroup.of(s))
    first: dict[int, float] = {}
    steps = 0
    start = time.perf_counter()
    while (plan := sched.schedule()) is not None:
        events = sched.update(plan, runner.execute(plan))
        now = time.perf_counter() - start
        steps += 1
        for event in events:
            first.setdefault(event.seq.seq_id, now)
    seconds = time.perf_counter() - start
    return Run(
        outputs=[list(s.output_token_ids) for s in seqs],
        seconds=seconds,
        steps=steps,
        first_token_s=[first[s.seq_id] for s in seqs if s.seq_id in first],
    )


def teacher_forced_logits(runner: Any, token_ids: list[int]) -> Any:
    """float32 logits [len, vocab] of a sequence fed in one prompt step from an empty cache:
    what the reference's forward pass over the same ids gives."""
    from tests.plans import Feed, make_plan

    blocks = list(range(-(-len(token_ids) // runner.block_size)))
    return runner.logits(make_plan(0, [Feed(0, list(token_ids), 0, blocks)]))
