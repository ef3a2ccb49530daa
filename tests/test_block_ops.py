"""Worker block operations (swap out, swap in, copy), sampled-token logprobs, and their wire form."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from common import worker_wire
from common.block_tables import BlockTables
from common.config import CacheConfig, WorkerConfig
from common.pb.llmserve.v1 import worker_pb2 as worker_pb
from common.plan import StepPlan, StepResult
from common.worker_info import WorkerInfo
from tests.conftest import skip_without_cuda
from tests.plans import Feed, make_plan
from worker_svc.models.shape import ModelShape
from worker_svc.step.kv_cache import GIB, KVCache
from worker_svc.step.runner import ModelRunner, PlanError

BLOCK = 8
GPU_BLOCKS = 16
CPU_BLOCKS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("block-ops-model")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=200,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.3,
    )
    LlamaForCausalLM(cfg).float().save_pretrained(str(path))
    return path


def make_runner(model_dir: Path, **cache: object) -> ModelRunner:
    return ModelRunner(
        WorkerConfig(
            model=str(model_dir),
            dtype="float32",
            device="cpu",
            attention_backend="torch",
            cache=CacheConfig(block_size=BLOCK, num_gpu_blocks=GPU_BLOCKS, **cache),
        )
    )  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def runner(model_dir: Path) -> ModelRunner:
    return make_runner(model_dir, num_cpu_blocks=CPU_BLOCKS)


def ops_only(step_id: int = 0, /, **ops: list[list[int]]) -> StepPlan:
    """A plan of zero sequences that only moves blocks."""
    return StepPlan(
        step_id=step_id,
        seq_ids=np.zeros(0, np.int64),
        query_lens=np.zeros(0, np.int32),
        context_lens=np.zeros(0, np.int32),
        input_ids=np.zeros(0, np.int32),
        block_tables=BlockTables(),
        sample=np.zeros(0, np.uint8),
        **{name: np.array(pairs, np.int32).reshape(-1, 2) for name, pairs in ops.items()},  # type: ignore[arg-type]
    )


def with_fields(plan: StepPlan, **fields: object) -> StepPlan:
    return dataclasses.replace(plan, **fields)  # type: ignore[arg-type]


def with_logprobs(plan: StepPlan, num_logprobs: list[int]) -> StepPlan:
    return with_fields(plan, sampling=dataclasses.replace(plan.sampling, num_logprobs=np.array(num_logprobs, np.int32)))


def scramble(kv: KVCache, seed: int) -> None:
    """Distinct random contents in every device and host block."""
    gen = torch.Generator().manual_seed(seed)
    for layer in (*kv.layers, *kv.host_layers):
        for t in layer:
            t.copy_(torch.randn(t.shape, generator=gen))


def device_block(kv: KVCache, i: int) -> torch.Tensor:
    return torch.stack([t[i] for layer in kv.layers for t in layer]).clone()  # [layers * 2, block, kv_heads, head_dim]


def host_block(kv: KVCache, i: int) -> torch.Tensor:
    return torch.stack([t[i] for layer in kv.host_layers for t in layer]).clone()


def snapshot(kv: KVCache) -> list[torch.Tensor]:
    return [t.clone() for layer in (*kv.layers, *kv.host_layers) for t in layer]


def test_swap_out_then_swap_in_restores_blocks_at_new_ids(runner: ModelRunner) -> None:
    kv = runner.kv
    scramble(kv, 1)
    want = {3: device_block(kv, 3), 7: device_block(kv, 7)}
    runner.execute(ops_only(swap_out=[[3, 0], [7, 5]]))
    assert torch.equal(host_block(kv, 0), want[3]) and torch.equal(host_block(kv, 5), want[7])

    for layer in kv.layers:  # the device blocks go to other sequences meanwhile
        for t in layer:
            t.fill_(-7.0)
    untouched = [host_block(kv, i) for i in range(CPU_BLOCKS)]
    runner.execute(ops_only(swap_in=[[0, 10], [5, 2]]))
    assert torch.equal(device_block(kv, 10), want[3]) and torch.equal(device_block(kv, 2), want[7])
    others = [i for i in range(GPU_BLOCKS) if i not in (10, 2)]
    assert all(bool((device_block(kv, i) == -7.0).all()) for i in others)
    assert all(torch.equal(host_block(kv, i), untouched[i]) for i in range(CPU_BLOCKS))


def test_copy_duplicates_blocks_reading_every_source_before_writing(runner: ModelRunner) -> None:
    kv = runner.kv
    scramble(kv, 2)
    before = [device_block(kv, i) for i in range(GPU_BLOCKS)]
    runner.execute(ops_only(copy=[[4, 9], [9, 1]]))
    after = [device_block(kv, i) for i in range(GPU_BLOCKS)]
    assert torch.equal(after[9], before[4]) and torch.equal(after[1], before[9])
    assert all(torch.equal(after[i], before[i]) for i in range(GPU_BLOCKS) if i not in (9, 1))


@pytest.mark.parametrize(
    ("ops", "message"),
    [
        ({"swap_out": [[16, 0]]}, "swap_out source block outside the device pool of 16"),
        ({"swap_out": [[0, 8]]}, "swap_out destination block outside the host pool of 8"),
        ({"swap_in": [[-1, 0]]}, "swap_in source block outside the host pool of 8"),
        ({"swap_in": [[0, 16]]}, "swap_in destination block outside the device pool of 16"),
        ({"copy": [[0, -1]]}, "copy destination block outside the device pool"),
        ({"copy": [[0, 1], [2, 1]]}, "copy writes a device block twice"),
        # every op is checked before the first one runs
        ({"swap_out": [[1, 1]], "swap_in": [[2, 2]], "copy": [[3, 99]]}, "copy destination"),
    ],
)
def test_block_ops_outside_the_pools_are_refused_before_touching_the_cache(
    runner: ModelRunner, ops: dict[str, list[list[int]]], message: str
) -> None:
    scramble(runner.kv, 3)
    before = snapshot(runner.kv)
    with pytest.raises(PlanError, match=message):
        runner.execute(ops_only(**ops))
    with pytest.raises(PlanError, match=message):  # also when the plan feeds sequences
        runner.execute(
            with_fields(
                make_plan(0, [Feed(0, [1, 2], 0, [4])]),
                **{name: np.array(pairs, np.int32) for name, pairs in ops.items()},
            )
        )
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(runner.kv)))


def test_block_ops_of_the_wrong_shape_are_refused(runner: ModelRunner) -> None:
    with pytest.raises(PlanError, match=r"plan.swap_in has shape \(1, 3\)"):
        runner.execute(with_fields(ops_only(), swap_in=np.zeros((1, 3), np.int32)))


def test_decode_after_swapping_out_and_back_in_elsewhere_equals_decode_without(runner: ModelRunner) -> None:
    prompt = [5, 17, 42, 99, 3, 8, 61, 7, 150, 33, 2]  # 11 tokens: two blocks of 8
    old, new = [3, 9], [12, 5]
    scramble(runner.kv, 4)
    first = int(runner.execute(make_plan(0, [Feed(0, prompt, 0, old)])).sampled_token_ids[0])
    decode = make_plan(1, [Feed(0, [first], len(prompt), old, output_position=1)])
    want_logits = runner.logits(decode)
    want = runner.execute(with_logprobs(decode, [5]))

    scramble(runner.kv, 5)
    assert int(runner.execute(make_plan(0, [Feed(0, prompt, 0, old)])).sampled_token_ids[0]) == first
    runner.execute(ops_only(swap_out=[[3, 6], [9, 1]]))
    scramble_device_only = torch.Generator().manual_seed(6)
    for layer in runner.kv.layers:
        for t in layer:
            t.copy_(torch.randn(t.shape, generator=scramble_device_only))
    # swap-in and decode in one step: the blocks must land before the forward pass reads them
    moved = make_plan(1, [Feed(0, [first], len(prompt), new, output_position=1)])
    got = runner.execute(with_fields(with_logprobs(moved, [5]), swap_in=np.array([[6, 12], [1, 5]], np.int32)))
    # Bit for bit: the same arithmetic, only the block addresses differ.
    for name in ("sampled_token_ids", "logprobs", "top_token_ids", "top_logprobs"):
        assert np.array_equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(runner.logits(moved), want_logits)


def test_logprobs_are_log_softmax_of_raw_logits_with_padded_top_k(runner: ModelRunner) -> None:
    feeds = [
        Feed(0, [5, 6, 7], 0, [0]),
        Feed(1, [8, 9], 0, [1], sample=False),
        Feed(2, [10, 11, 12, 13], 0, [2], temperature=0.7, seed=3),  # logprobs ignore temperature
        Feed(3, [14], 0, [3]),
    ]
    plan = with_logprobs(make_plan(0, feeds), [4, 6, 0, 1])  # K = 4: the unsampled row's 6 does not count
    last = np.cumsum([len(f.token_ids) for f in feeds]) - 1
    # Within 1e-6, not exact: these logits come from a matmul over all 10 tokens, the worker's
    # from one over the 4 sampled rows, and BLAS rounds the two shapes differently.
    reference = torch.log_softmax(runner.logits(plan)[torch.from_numpy(last)], dim=-1)  # [4, vocab]
    result = runner.execute(plan)

    sampled = result.sampled_token_ids
    assert sampled[1] == -1
    assert result.logprobs.shape == (4,) and np.isnan(result.logprobs[1])
    for row in (0, 2, 3):
        assert result.logprobs[row] == pytest.approx(float(reference[row, sampled[row]]), abs=1e-6)
    values, ids = reference.topk(4, dim=-1)
    assert result.top_token_ids.shape == result.top_logprobs.shape == (4, 4)
    assert result.top_token_ids[0].tolist() == ids[0].tolist()
    np.testing.assert_allclose(result.top_logprobs[0], values[0].numpy(), rtol=0, atol=1e-6)
    assert result.top_token_ids[3].tolist() == [int(ids[3, 0]), -1, -1, -1]
    assert result.top_logprobs[3, 0] == pytest.approx(float(values[3, 0]), abs=1e-6)
    for row in (1, 2):
        assert result.top_token_ids[row].tolist() == [-1] * 4
        assert result.top_logprobs[row].tolist() == [-np.inf] * 4
    assert result.top_logprobs.dtype == np.float32 and result.top_token_ids.dtype == np.int32


def test_logprobs_without_top_k_or_sampled_rows(runner: ModelRunner) -> None:
    plan = make_plan(0, [Feed(0, [5, 6], 0, [0]), Feed(1, [7], 0, [1])])  # num_logprobs empty: 0 for all
    result = runner.execute(plan)
    assert result.logprobs.shape == (2,) and not np.isnan(result.logprobs).any()
    assert result.top_token_ids.shape == result.top_logprobs.shape == (2, 0)

    quiet = runner.execute(make_plan(1, [Feed(0, [5, 6], 0, [0], sample=False)]))
    assert np.isnan(quiet.logprobs).tolist() == [True]
    assert quiet.top_token_ids.shape == (1, 0)


def test_swap_pool_size_from_swap_space_gb_and_reported_in_worker_info(model_dir: Path) -> None:
    # 2 layers * (K, V) * 8 tokens * 2 kv heads * head_dim 16 * 4 bytes
    block_bytes = 2 * 2 * BLOCK * 2 * 16 * 4
    sized = make_runner(model_dir, swap_space_gb=3.5 * block_bytes / GIB)
    info = sized.info("tiny")
    assert (info.num_gpu_blocks, info.num_cpu_blocks, info.block_bytes) == (GPU_BLOCKS, 3, block_bytes)
    assert not sized.kv.pinned  # pinning is for CUDA devices only

    disabled = make_runner(model_dir, swap_space_gb=0.0)
    assert disabled.info("tiny").num_cpu_blocks == 0
    with pytest.raises(PlanError, match="host pool of 0 blocks"):
        disabled.execute(ops_only(swap_out=[[0, 0]]))


@skip_without_cuda()
def test_swap_round_trip_through_the_pinned_pool_on_cuda() -> None:
    shape = ModelShape(
        architecture="LlamaForCausalLM",
        vocab_size=8,
        hidden_size=64,
        intermediate_size=64,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        qkv_bias=False,
        o_bias=False,
    )
    kv = KVCache(shape, 8, BLOCK, torch.bfloat16, torch.device("cuda"), num_cpu_blocks=4)
    assert kv.pinned and all(t.is_pinned() for layer in kv.host_layers for t in layer)
    for layer in kv.layers:
        for t in layer:
            t.copy_(torch.randn(t.shape, device="cuda"))
    want = [device_block(kv, 2), device_block(kv, 6)]
    kv.swap_out(np.array([[2, 3], [6, 0]], np.int32))
    for layer in kv.layers:
        for t in layer:
            t.zero_()
    kv.swap_in(np.array([[3, 7], [0, 1]], np.int32))
    kv.copy(np.array([[7, 4]], np.int32))
    torch.cuda.synchronize()
    assert torch.equal(device_block(kv, 7), want[0]) and torch.equal(device_block(kv, 1), want[1])
    assert torch.equal(device_block(kv, 4), want[0])


# ---- wire ----


def test_plan_block_ops_and_num_logprobs_survive_the_wire() -> None:
    base = make_plan(7, [Feed(0, [1, 2, 3], 4, [5, 6]), Feed(1, [9], 0, [2], sample=False)])
    plans = [
        base,  # no block ops, num_logprobs empty
        with_fields(
            with_logprobs(base, [3, 0]),
            swap_out=np.array([[5, 0], [6, 1]], np.int32),
            swap_in=np.array([[2, 11]], np.int32),
            copy=np.array([[11, 12], [5, 13]], np.int32),
        ),
        ops_only(3, swap_out=[[4, 2]]),
    ]
    for plan in plans:
        data = worker_wire.encode_plan(plan).SerializeToString()
        back = worker_wire.decode_plan(worker_pb.StepPlan.FromString(data))
        assert back.step_id == plan.step_id
        for name in (
            "seq_ids",
            "query_lens",
            "context_lens",
            "input_ids",
            "sample",
            "swap_out",
            "swap_in",
            "copy",
        ):
            got, want = getattr(back, name), getattr(plan, name)
            assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want), name
        for name in ("offsets", "ids"):
            got, want = getattr(back.block_tables, name), getattr(plan.block_tables, name)
            assert got.dtype == want.dtype and np.array_equal(got, want), name
        for name in ("temperature", "top_p", "top_k", "seed", "output_position", "num_logprobs"):
            got, want = getattr(back.sampling, name), getattr(plan.sampling, name)
            assert got.dtype == want.dtype and np.array_equal(got, want), name


def test_odd_block_op_lengths_are_refused_on_decode() -> None:
    msg = worker_wire.encode_plan(ops_only())
    msg.copy = np.array([1, 2, 3], "<i4").tobytes()
    with pytest.raises(ValueError, match="copy: 3 values is not a whole number of"):
        worker_wire.decode_plan(msg)


@pytest.mark.parametrize(
    "result",
    [
        StepResult(
            step_id=4,
            sampled_token_ids=np.array([7, -1, 3], np.int32),
            execute_seconds=0.25,
            logprobs=np.array([-0.5, np.nan, -2.25], np.float32),
            top_token_ids=np.array([[7, 1], [-1, -1], [3, -1]], np.int32),
            top_logprobs=np.array([[-0.5, -1.5], [-np.inf, -np.inf], [-0.125, -np.inf]], np.float32),
        ),
        StepResult(
            4,
            np.array([7, 8], np.int32),
            0.0,
            np.array([-0.5, -1.0], np.float32),
            np.zeros((2, 0), np.int32),
            np.zeros((2, 0), np.float32),
        ),
        StepResult(5, np.array([-1], np.int32)),  # nothing sampled, defaults
    ],
)
def test_step_result_logprobs_survive_the_wire(result: StepResult) -> None:
    n = result.sampled_token_ids.shape[0]
    data = worker_wire.encode_result(result).SerializeToString()
    back = worker_wire.decode_result(worker_pb.StepResult.FromString(data), n)
    assert (back.step_id, back.execute_seconds) == (result.step_id, result.execute_seconds)
    np.testing.assert_array_equal(back.sampled_token_ids, result.sampled_token_ids)
    np.testing.assert_array_equal(back.logprobs, result.logprobs)
    width = result.top_token_ids.shape[1]
    assert back.top_token_ids.shape == back.top_logprobs.shape == (n, width)
    np.testing.assert_array_equal(back.top_token_ids, result.top_token_ids.reshape(n, width))
    np.testing.assert_array_equal(back.top_logprobs, result.top_logprobs.reshape(n, width))


def test_worker_info_carries_block_bytes() -> None:
    info = WorkerInfo("m", 200, 64, "float32", "cpu", 0, 1, 8, 16, 8, block_bytes=2048)
    msg = worker_pb.WorkerInfo.FromString(worker_wire.encode_worker_info(info).SerializeToString())
    assert worker_wire.decode_worker_info(msg) == info


def test_default_pools_are_sized_from_the_available_memory(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No --kv-cache-gb or --swap-space-gb: on a CPU worker the KV pool takes 2 GiB or 30% of
    the available memory if less, the swap pool 1 GiB or 10%."""
    from worker_svc.step import host_memory

    block_bytes = 2 * 2 * BLOCK * 2 * 16 * 4
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 1000 * block_bytes)
    small = ModelRunner(
        WorkerConfig(
            model=str(model_dir),
            dtype="float32",
            device="cpu",
            attention_backend="torch",
            cache=CacheConfig(block_size=BLOCK),
        )
    )
    assert (small.kv.num_blocks, small.kv.num_cpu_blocks) == (300, 100)
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 64 * GIB)
    assert host_memory.default_cpu_kv_bytes(host_memory.available_bytes()) == 2 * GIB
    assert host_memory.default_swap_bytes("cpu", host_memory.available_bytes()) == 1 * GIB
    assert host_memory.default_swap_bytes("cuda", host_memory.available_bytes()) == 4 * GIB


def test_available_memory_is_read_from_the_machine() -> None:
    from worker_svc.step import host_memory

    assert 0 < host_memory.available_bytes() < 1 << 50
