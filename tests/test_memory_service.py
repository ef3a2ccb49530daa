"""KV memory management through the real services: a worker process with a KV pool of a few
dozen blocks and a small swap pool, the scheduler service on a real port, gRPC clients.

The tiny random model is float32 with peaked logits, so a request's greedy tokens do not
depend on batch composition, swapping, recomputation or prefix reuse: any difference is a bug.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from common.pb.llmserve.v1 import generation_pb2 as pb
from tests.conftest import (
    Generation,
    Scheduler,
    WorkerProcess,
    collect,
    request,
    start_scheduler,
    start_worker,
    stop_scheduler,
)
from tests.engine_state import first_scheduler


def by_index(gen: Generation) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for m in gen.messages:
        out.setdefault(m.index, []).extend(m.token_ids)
    return out


@pytest.fixture(scope="module")
def small_pool_worker(tiny_model_dir: Path) -> Iterator[WorkerProcess]:
    worker = start_worker(tiny_model_dir, "--num-gpu-blocks", "40", "--num-cpu-blocks", "12")
    yield worker
    worker.stop()


@pytest.fixture
async def small_pool(tiny_model_dir: Path, small_pool_worker: WorkerProcess) -> AsyncIterator[Scheduler]:
    """40 device blocks of 16 tokens and a 12-block swap pool, a fresh scheduler per test on the
    module's worker; afterwards both pools are free."""
    s = await start_scheduler(tiny_model_dir, small_pool_worker.address)
    try:
        await s.wait_ready()
        yield s
        await s.wait_idle()
    finally:
        await stop_scheduler(s)


async def test_24_concurrent_requests_through_swap_and_recompute_are_exact(small_pool: Scheduler) -> None:
    # 24 requests growing to 36-59 + 40 tokens (5-7 blocks each): ~140 blocks wanted, 40 held.
    prompts = [[300 + 13 * i + k for k in range(36 + i)] for i in range(24)]
    solo = [await collect(small_pool.stub, request(ids=p, max_tokens=40, ignore_eos=True)) for p in prompts]
    sched = first_scheduler(small_pool.engine)
    assert sched.queues.num_preemptions == 0
    together = await asyncio.gather(
        *(collect(small_pool.stub, request(ids=p, max_tokens=40, ignore_eos=True)) for p in prompts)
    )
    assert sched.queues.num_swap_preemptions > 0, "the swap pool was never used"
    assert sched.queues.num_recompute_preemptions > 0, "the swap pool never ran full"
    assert [g.token_ids for g in together] == [g.token_ids for g in solo]
    assert [g.text for g in together] == [g.text for g in solo]
    stats = [g.final.stats for g in together]
    assert sum(st.num_preemptions for st in stats) == sched.queues.num_preemptions
    assert sum(st.num_swaps for st in stats) == sched.queues.num_swap_preemptions
    assert all(st.swapped_bytes > 0 for st in stats if st.num_swaps)
    await small_pool.wait_idle()


async def test_repeated_long_prompt_is_served_from_the_prefix_cache(small_pool: Scheduler) -> None:
    prompt = [500 + (7 * k) % 900 for k in range(200)]
    first = await collect(small_pool.stub, request(ids=prompt, max_tokens=12, ignore_eos=True))
    second = await collect(small_pool.stub, request(ids=prompt, max_tokens=12, ignore_eos=True))
    assert first.final.stats.prefix_cache_hit_tokens == 0
    assert second.final.stats.prefix_cache_hit_tokens == 192  # 12 full blocks; the last token is computed
    assert second.token_ids == first.token_ids and second.text == first.text


async def test_prefix_caching_can_be_turned_off(tiny_model_dir: Path, tiny_worker) -> None:  # type: ignore[no-untyped-def]
    s = await start_scheduler(tiny_model_dir, tiny_worker.address, enable_prefix_caching=False)
    try:
        await s.wait_ready()
        prompt = [600 + k for k in range(100)]
        gens = [await collect(s.stub, request(ids=prompt, max_tokens=4, ignore_eos=True)) for _ in range(2)]
        assert [g.final.stats.prefix_cache_hit_tokens for g in gens] == [0, 0]
        assert gens[0].token_ids == gens[1].token_ids
        await s.wait_idle()
    finally:
        await stop_scheduler(s)


async def test_n_seeded_samples_differ_and_reproduce(small_pool: Scheduler) -> None:
    req = request(ids=[700 + k for k in range(21)], max_tokens=8, ignore_eos=True, temperature=5.0, seed=11, n=4)
    first, again = [await collect(small_pool.stub, req) for _ in range(2)]
    outs = by_index(first)
    assert sorted(outs) == [0, 1, 2, 3] and all(len(o) == 8 for o in outs.values())
    assert len({tuple(o) for o in outs.values()}) == 4
    assert by_index(again) == outs
    finals = [m for m in first.messages if m.finish_reason != pb.FINISH_REASON_UNSPECIFIED]
    assert sorted(m.index for m in finals) == [0, 1, 2, 3]


async def test_best_of_returns_n_outputs_at_the_end(small_pool: Scheduler) -> None:
    req = request(
        ids=[800 + k for k in range(9)], max_tokens=6, ignore_eos=True, temperature=5.0, seed=3, n=2, best_of=5
    )
    gen = await collect(small_pool.stub, req)
    assert [m.index for m in gen.messages] == [0, 1]
    assert all(len(m.token_ids) == 6 and m.finish_reason == pb.FINISH_REASON_LENGTH for m in gen.messages)
    assert gen.messages[0].cumulative_logprob >= gen.messages[1].cumulative_logprob


async def test_beam_search_returns_ranked_beams(small_pool: Scheduler) -> None:
    gen = await collect(
        small_pool.stub, request(ids=[900 + k for k in range(17)], max_tokens=6, ignore_eos=True, beam_width=4, n=3)
    )
    assert [m.index for m in gen.messages] == [0, 1, 2]
    scores = [m.cumulative_logprob / len(m.token_ids) for m in gen.messages]
    assert scores == sorted(scores, reverse=True)
    assert len({tuple(m.token_ids) for m in gen.messages}) == 3


@pytest.mark.parametrize(
    ("fields", "code", "match"),
    [
        ({"beam_width": 2, "temperature": 1.0}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature"),
        ({"beam_width": 2, "n": 3}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.n"),
        ({"n": 3, "best_of": 2}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.best_of"),
        ({"n": 17}, grpc.StatusCode.INVALID_ARGUMENT, "at most 16"),
        ({"beam_width": 2, "stop": ["x"]}, grpc.StatusCode.UNIMPLEMENTED, "stop strings with beam search"),
        # 16 samples of up to 500 tokens could never share 40 blocks.
        ({"n": 16, "max_tokens": 480, "temperature": 1.0}, grpc.StatusCode.RESOURCE_EXHAUSTED, "KV blocks"),
    ],
)
async def test_bad_widths_are_refused(small_pool: Scheduler, fields: dict, code: grpc.StatusCode, match: str) -> None:
    max_tokens = fields.pop("max_tokens", 4)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(small_pool.stub, request(ids=[5, 6, 7], max_tokens=max_tokens, **fields))
    assert err.value.code() == code and match in (err.value.details() or "")


async def test_a_full_waiting_queue_refuses_with_resource_exhausted(tiny_model_dir: Path, tiny_worker) -> None:  # type: ignore[no-untyped-def]
    s = await start_scheduler(tiny_model_dir, tiny_worker.address, max_num_seqs=1, max_queue_len=2)
    try:
        await s.wait_ready()
        results = await asyncio.gather(
            *(collect(s.stub, request(ids=[40 + i, 41, 42], max_tokens=30, ignore_eos=True)) for i in range(6)),
            return_exceptions=True,
        )
        refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
        served = [r for r in results if isinstance(r, Generation)]
        assert refused and all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in refused)
        assert "--max-queue-len" in (refused[0].details() or "")
        # The queue's 2, and a third only if the step loop moved the first into the running
        # queue before the others arrived, which a busy machine may not let it do.
        assert len(served) >= 2 and all(len(g.token_ids) == 30 for g in served)
        await s.wait_idle()
    finally:
        await stop_scheduler(s)


async def test_priority_request_overtakes_a_busy_pool(small_pool: Scheduler) -> None:
    background = [
        asyncio.create_task(
            collect(
                small_pool.stub,
                request(ids=[100 + 9 * i + k for k in range(40)], max_tokens=60, ignore_eos=True, priority=5),
            )
        )
        for i in range(10)
    ]
    await asyncio.sleep(0.3)
    urgent = await collect(small_pool.stub, request(ids=[77, 78, 79], max_tokens=5, ignore_eos=True, priority=-1))
    assert len(urgent.token_ids) == 5
    assert not all(t.done() for t in background)  # it finished while the low-priority work still ran
    done = await asyncio.gather(*background)
    assert all(len(g.token_ids) == 60 for g in done)
