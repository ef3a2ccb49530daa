"""A tensor-parallel group as the scheduler drives it: lockstep fan-out, rank 0's answer,
the smallest capacity, and a lost rank losing the group with its name in the error."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from common.plan import StepPlan, StepResult
from common.worker_info import WorkerInfo
from scheduler_svc.workers.rank_links import RankLinks
from scheduler_svc.workers.worker_client import StepTiming, WorkerLost
from tests.plans import Feed, make_plan

INFO = WorkerInfo("m", 100, 512, "float32", "cpu", 0, 3, 16, 64, 8)


class FakeRank:
    def __init__(self, address: str, info: WorkerInfo, token: int, delay: float = 0.0, fail: bool = False) -> None:
        self.address, self.info, self.token, self.delay, self.fail = address, info, token, delay, fail
        self.plans: list[int] = []
        self.closed = False

    async def connect(self, timeout: float) -> WorkerInfo:
        return self.info

    async def write(self, plan: StepPlan, msg: object, encode_seconds: float = 0.0) -> None:
        self.plans.append(plan.step_id)

    async def receive(self, plan: StepPlan) -> tuple[StepResult, StepTiming]:
        await asyncio.sleep(self.delay)
        if self.fail:
            raise WorkerLost(f"worker {self.address} closed its step stream")
        tokens = np.full(plan.num_seqs, self.token, np.int32)
        return StepResult(plan.step_id, tokens), StepTiming(10, self.delay, self.delay / 2)

    async def close(self) -> None:
        self.closed = True


def decode_plan(step_id: int) -> StepPlan:
    return make_plan(step_id, [Feed(i, [5], context_len=3, block_table=[i]) for i in range(2)])


def group_of(*ranks: FakeRank) -> RankLinks:
    group = RankLinks([r.address for r in ranks])
    group.ranks = list(ranks)  # type: ignore[assignment]
    return group


def info(rank: int, **changes: object) -> WorkerInfo:
    return dataclasses.replace(INFO, rank=rank, **changes)  # type: ignore[arg-type]


async def test_every_rank_runs_the_step_and_rank_0_answers() -> None:
    ranks = [
        FakeRank(f"r{i}", info(i, num_gpu_blocks=64 - i, num_cpu_blocks=8 + i), token=100 + i, delay=0.01 * i)
        for i in range(3)
    ]
    group = group_of(*ranks)
    merged = await group.connect(1.0)
    assert (merged.num_gpu_blocks, merged.num_cpu_blocks, merged.world_size) == (62, 8, 3)
    plan = decode_plan(step_id=7)
    result, timing = await group.execute(plan)
    assert result.sampled_token_ids.tolist() == [100] * plan.num_seqs
    assert [r.plans for r in ranks] == [[7], [7], [7]]
    assert timing.roundtrip_seconds == pytest.approx(0.02)  # the slowest rank


async def test_a_failed_rank_loses_the_group_naming_it() -> None:
    group = group_of(FakeRank("a", info(0), 1), FakeRank("b", info(1), 1, fail=True), FakeRank("c", info(2), 1))
    await group.connect(1.0)
    with pytest.raises(WorkerLost, match="rank 1 of group a,b,c"):
        await group.execute(decode_plan(step_id=1))


@pytest.mark.parametrize(
    ("infos", "message"),
    [
        ([info(0), info(2), info(1)], "address 1 is rank 2"),
        ([info(0, world_size=2), info(1, world_size=2), info(2, world_size=2)], "reports a group of 2"),
        ([info(0), info(1, block_size=32), info(2)], "rank 1 has block_size 32"),
    ],
)
async def test_ranks_that_are_not_one_group_are_refused(infos: list[WorkerInfo], message: str) -> None:
    ranks = [FakeRank(f"r{i}", inf, 1) for i, inf in enumerate(infos)]
    with pytest.raises(WorkerLost, match=message):
        await group_of(*ranks).connect(1.0)
    assert all(r.closed for r in ranks)
