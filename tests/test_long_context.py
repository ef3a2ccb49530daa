"""Long contexts end to end: a 32k-token prompt through a real worker and scheduler gives
transformers' greedy tokens on both CPU attention paths, and prompts past the context or
the KV pool are refused with the limit and the flag that raises it.

The model is a random-weight Llama with one head of 64 (the C++ kernels' smallest), float32,
so that a 32k prompt (16 chunks of 2,048 over a growing context) costs seconds, not minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from tests.conftest import (
    WorkerProcess,
    collect,
    make_tiny_model,
    request,
    start_scheduler,
    start_worker,
    stop_scheduler,
)

PROMPT_TOKENS = 32 * 1024
NEW_TOKENS = 8
FIRST_CHUNK = 2048  # the scheduler's default token budget: the prompt goes in 16 chunks
# This request's blocks and a few more: a table naming a wrong block reads another position's KV.
POOL_BLOCKS = (PROMPT_TOKENS + NEW_TOKENS) // 16 + 8


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("long") / "tiny-long",
        smollm2_dir,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=PROMPT_TOKENS + 64,
    )


@pytest.fixture(scope="module")
def long_prompt() -> list[int]:
    return torch.randint(3, 49152, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.fixture(scope="module")
def reference(long_model: Path, long_prompt: list[int]) -> list[int]:
    """transformers' greedy tokens; SDPA keeps its causal prefill from building a 32k x 32k mask."""
    from transformers import LlamaForCausalLM

    ref = LlamaForCausalLM.from_pretrained(str(long_model), dtype=torch.float32, attn_implementation="sdpa").eval()
    ref.generation_config.eos_token_id = None  # the service runs with ignore_eos

    def greedy(ids: list[int]) -> list[int]:
        with torch.no_grad():
            out = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0)
        return out[0, len(ids) :].tolist()

    want = greedy(long_prompt)
    # The first chunk's tokens decide the output: a path that lost the start of the context
    # (a table cut short, a chunk attending only to itself) could not pass by chance.
    assert greedy([(t * 7 + 1) % 49152 for t in long_prompt[:FIRST_CHUNK]] + long_prompt[FIRST_CHUNK:]) != want
    return want


async def _greedy(model: Path, worker: WorkerProcess, prompt: list[int]) -> list[int]:
    scheduler = await start_scheduler(model, worker.address)
    try:
        await scheduler.wait_ready()
        gen = await collect(scheduler.stub, request(ids=prompt, max_tokens=NEW_TOKENS, ignore_eos=True))
        await scheduler.wait_idle()  # every block back in the free pool
        return gen.token_ids
    finally:
        await stop_scheduler(scheduler)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
async def test_a_32k_prompt_gives_transformers_greedy_tokens(
    long_model: Path, long_prompt: list[int], reference: list[int], backend: str
) -> None:
    worker = start_worker(long_model, "--attention-backend", backend, "--num-gpu-blocks", str(POOL_BLOCKS))
    try:
        got = await _greedy(long_model, worker, long_prompt)
    finally:
        worker.stop()
    assert got == reference


# ---- refusals ----

CONTEXT = 512  # make_tiny_model's max_position_embeddings
SMALL_POOL = 16  # blocks of 16: 256 tokens, half the context


def _flags_of(command: str) -> set[str]:
    from llmserve.cli.parser import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {flag for action in sub.choices[command]._actions for flag in action.option_strings}


@pytest.fixture(scope="module")
def small_pool_worker(tiny_model_dir: Path) -> Iterator[WorkerProcess]:
    worker = start_worker(tiny_model_dir, "--num-gpu-blocks", str(SMALL_POOL))
    yield worker
    worker.stop()


async def _refusal(model: Path, worker: WorkerProcess, n: int, max_tokens: int) -> grpc.aio.AioRpcError:
    scheduler = await start_scheduler(model, worker.address)
    try:
        await scheduler.wait_ready()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await collect(scheduler.stub, request(ids=[100 + i % 1000 for i in range(n)], max_tokens=max_tokens))
        await scheduler.wait_idle()
        return refused.value
    finally:
        await stop_scheduler(scheduler)


def _assert_names_flags_that_exist(details: str, *limits: str) -> None:
    for limit in limits:
        assert limit in details, details
    named = set(re.findall(r"--[a-z][a-z-]+", details))
    assert named, f"no flag named in: {details}"
    # Every flag the message sends the operator to must be one `llmserve up` accepts.
    assert named <= _flags_of("up"), f"{sorted(named - _flags_of('up'))} are no flags of `llmserve up`: {details}"


@pytest.mark.parametrize(
    ("prompt", "max_tokens"), [(CONTEXT, 1), (CONTEXT // 2, CONTEXT)], ids=["prompt", "max_tokens"]
)
async def test_past_the_context_is_refused_naming_it_and_its_flag(
    tiny_model_dir: Path, small_pool_worker: WorkerProcess, prompt: int, max_tokens: int
) -> None:
    error = await _refusal(tiny_model_dir, small_pool_worker, prompt, max_tokens)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    _assert_names_flags_that_exist(error.details() or "", f"context of {CONTEXT} tokens")


async def test_past_the_kv_pool_is_refused_naming_it_and_its_flags(
    tiny_model_dir: Path, small_pool_worker: WorkerProcess
) -> None:
    # Inside the context (300 + 8 < 512), over the pool (256 tokens).
    error = await _refusal(tiny_model_dir, small_pool_worker, 300, 8)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    _assert_names_flags_that_exist(error.details() or "", f"{SMALL_POOL} blocks of 16", "--num-gpu-blocks")


async def test_a_prompt_that_fits_the_small_pool_runs(tiny_model_dir: Path, small_pool_worker: WorkerProcess) -> None:
    scheduler = await start_scheduler(tiny_model_dir, small_pool_worker.address)
    try:
        await scheduler.wait_ready()
        gens = await asyncio.gather(
            *(collect(scheduler.stub, request(ids=[100] * 200, max_tokens=8)) for _ in range(2))
        )
        await scheduler.wait_idle()
    finally:
        await stop_scheduler(scheduler)
    assert [len(g.token_ids) for g in gens] == [8, 8]


TRITON_PROMPT = 2048  # the interpreter runs a program in ~0.3 ms: a smaller context


def test_triton_kernels_in_the_interpreter_follow_a_long_row_beside_a_short_one(long_model: Path) -> None:
    """The Triton backend (interpreted on a CPU) prefills a 2k prompt in chunks of 512 and
    decodes it beside a 16-token sequence whose table is 2 blocks long, the long row's 129:
    greedy tokens equal transformers'."""
    from transformers import LlamaForCausalLM

    from common.config import CacheConfig, WorkerConfig
    from tests.conftest import KERNEL_DEVICE
    from tests.plans import Feed, make_plan
    from worker_svc.step.runner import ModelRunner

    prompt = torch.randint(3, 49152, (TRITON_PROMPT,), generator=torch.Generator().manual_seed(11)).tolist()
    ref = LlamaForCausalLM.from_pretrained(str(long_model), dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        want = ref.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=4, pad_token_id=0, eos_token_id=None
        )
    runner = ModelRunner(
        WorkerConfig(
            model=str(long_model),
            dtype="float32",
            device=KERNEL_DEVICE,
            attention_backend="triton",
            max_model_len=TRITON_PROMPT + 64,
            cache=CacheConfig(num_gpu_blocks=200),
        )
    )
    long_table, short_table = list(range(1, 1 + TRITON_PROMPT // 16 + 1)), [150, 151]
    short = list(range(100, 116))
    for step, start in enumerate(range(0, TRITON_PROMPT, 512)):
        result = runner.execute(make_plan(step, [Feed(0, prompt[start : start + 512], start, long_table)]))
    got = [int(result.sampled_token_ids[0])]
    runner.execute(make_plan(10, [Feed(1, short[:15], 0, short_table, sample=False)]))
    for i in range(3):
        feeds = [
            Feed(0, got[-1:], TRITON_PROMPT + i, long_table),
            Feed(1, short[15:] if i == 0 else [7], 15 + i, short_table),
        ]
        got.append(int(runner.execute(make_plan(11 + i, feeds)).sampled_token_ids[0]))
    assert got == want[0, TRITON_PROMPT:].tolist()


def test_a_plan_with_a_million_token_row_beside_255_short_ones_encodes_under_a_mib() -> None:
    """The scheduler's own plan for 255 decoding sequences of 16 blocks and one of 65,536
    (a 1M-token context): its tables are the blocks named, not 256 rows of the widest."""
    from common import worker_wire
    from scheduler_svc.kv.block_manager import BlockManager
    from scheduler_svc.sched.plan_builder import PlanBuilder
    from scheduler_svc.sched.sequence import SamplingOptions, Sequence, StoppingParams
    from scheduler_svc.sched.sequence_group import SequenceGroup

    bm = BlockManager(num_blocks=70_000, block_size=16)
    seqs, groups = [], {}
    for i, length in enumerate([256] * 255 + [1 << 20]):
        seq = Sequence(i, f"r{i}", [7] * length, SamplingOptions(), StoppingParams(max_tokens=4), arrival=i)
        bm.allocate(i, length)
        seq.num_computed_tokens = length - 1  # decoding its last token
        groups[i] = SequenceGroup.of(seq, 0)
        seqs.append(seq)
    plan = PlanBuilder(bm, groups=groups).build(0, seqs, [1] * 256)
    encoded = worker_wire.encode_plan(plan).SerializeToString()
    assert plan.block_tables.ids.size == 255 * 16 + 65_536
    assert len(encoded) < 1 << 20, len(encoded)
    back = worker_wire.decode_plan(type(worker_wire.encode_plan(plan)).FromString(encoded))
    assert back.block_tables.row(255).tolist() == bm.block_table(255)
