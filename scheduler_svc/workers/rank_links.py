"""The scheduler's links to the ranks of one tensor-parallel worker group, driven in lockstep.

Names, as the code uses them: a *sequence group* is one request's samples; a *worker group*
(`Replica`) is what one block manager serves, one worker or the ranks here; `RankLinks` are
the scheduler's connections to those ranks; `llmserve.rank_launcher.RankLauncher` starts
their processes; `worker_svc.device.parallel.ParallelGroup` is the torch.distributed group the ranks
compute in.

Every rank holds a slice of the weights and of the KV heads, so every rank must run every
step: the identical plan goes to all of them (encoded once), their collectives meet inside
the forward pass, and rank 0's result is the group's (all ranks sample the same tokens from
the same gathered logits). In a pipeline (WorkerInfo.pipeline_stages) every stage gets the
plan too, and the last stage's first rank answers for the group (WorkerInfo.driver_rank).
Capacity is the minimum over the ranks: a stage's KV pool holds only its layers.

Any rank failing, closing its stream or missing the step deadline loses the whole group: its
KV state is spread over all ranks. The error names the rank, and the ranks still alive fail
their next collective within the distributed timeout and exit, so nothing waits forever.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from common import worker_wire
from common.config import TlsClientConfig
from common.plan import StepPlan, StepResult
from common.worker_info import WorkerInfo
from scheduler_svc.workers.worker_client import StepTiming, WorkerClient, WorkerLost, WorkerRefused

T = TypeVar("T")


class RankLinks:
    def __init__(
        self,
        addresses: list[str],
        step_timeout: float = 600.0,
        tls: TlsClientConfig | None = None,
        health_interval: float = 5.0,
        token: str | None = None,
    ) -> None:
        if not addresses:
            raise ValueError("a worker group needs at least one rank address")
        # Each rank watches its own health; one that fails ends the group's step like a crash.
        self.ranks = [WorkerClient(a, step_timeout, tls, health_interval, token) for a in addresses]
        self.address = ",".join(addresses)
        self.driver = 0  # the rank whose result is the group's (set at connect)

    async def connect(self, timeout: float) -> WorkerInfo:
        """Describe every rank; the group's info is rank 0's with the smallest capacity."""
        results = await asyncio.gather(*(r.connect(timeout) for r in self.ranks), return_exceptions=True)
        failed = [(i, e) for i, e in enumerate(results) if isinstance(e, BaseException)]
        if failed:
            await self.close()
            # A rank that reported the impossible rules the group out; else the first failure.
            i, error = next(((i, e) for i, e in failed if isinstance(e, WorkerRefused)), failed[0])
            lost = WorkerRefused if isinstance(error, WorkerRefused) else WorkerLost
            raise lost(f"rank {i} ({self.ranks[i].address}): {error}")
        infos = [r for r in results if isinstance(r, WorkerInfo)]
        problem = _mismatch(infos)
        if problem:
            await self.close()
            raise WorkerRefused(f"worker group {self.address}: {problem}")
        self.driver = infos[0].driver_rank
        return dataclasses.replace(
            infos[0],
            num_gpu_blocks=min(i.num_gpu_blocks for i in infos),
            num_cpu_blocks=min(i.num_cpu_blocks for i in infos),
            # Every rank runs every slot the plan names: the group has what its smallest rank has.
            max_loras=min(i.max_loras for i in infos),
            max_lora_rank=min(i.max_lora_rank for i in infos),
        )

    async def execute(self, plan: StepPlan) -> tuple[StepResult, StepTiming]:
        await self.submit(plan)
        return await self.receive(plan)

    async def submit(self, plan: StepPlan) -> None:
        start = time.perf_counter()
        msg = worker_wire.encode_plan(plan)
        encode = time.perf_counter() - start
        await self._all(plan, [r.write(plan, msg, encode) for r in self.ranks])

    async def receive(self, plan: StepPlan) -> tuple[StepResult, StepTiming]:
        done = await self._all(plan, [r.receive(plan) for r in self.ranks])
        result, timing = done[self.driver]
        # The step lasts as long as its slowest rank.
        slowest = max(t.roundtrip_seconds for _, t in done)
        return result, StepTiming(
            timing.plan_bytes,
            slowest,
            max(t.execute_seconds for _, t in done),
            timing.encode_seconds,
            timing.decode_seconds,
        )

    async def _all(self, plan: StepPlan, calls: list[Coroutine[Any, Any, T]]) -> list[T]:
        """Every rank's answer; the first failure decides: the other ranks are blocked in a
        collective with the failed one and would answer only when the distributed timeout
        fails them too."""
        tasks = [asyncio.ensure_future(c) for c in calls]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            # The engine is stopping: end the rank calls here rather than leave them to fail
            # unobserved when the channels close.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        for i, task in enumerate(tasks):
            if task.done() and task.exception() is not None:
                for other in tasks:
                    other.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                error = task.exception()
                raise WorkerLost(f"rank {i} of group {self.address}: {error}") from error
        return [t.result() for t in tasks]

    async def close(self) -> None:
        await asyncio.gather(*(r.close() for r in self.ranks))


def _mismatch(infos: list[WorkerInfo]) -> str | None:
    """Why these ranks are not one group, or None. Each rank's numbers were bounded when it
    answered (WorkerClient.connect), so the group's minimum capacity is a sane one."""
    n = len(infos)
    for i, info in enumerate(infos):
        if info.world_size != n:
            return f"rank address {i} reports a group of {info.world_size}, {n} addresses were given"
        if info.rank != i:
            return f"address {i} is rank {info.rank}: list the ranks' addresses in rank order"
    first = infos[0]
    for info in infos[1:]:
        for field in ("model_name", "dtype", "block_size", "max_model_len", "vocab_size", "pipeline_stages"):
            if getattr(info, field) != getattr(first, field):
                return f"rank {info.rank} has {field} {getattr(info, field)!r}, rank 0 has {getattr(first, field)!r}"
    return None
