"""Triton kernels against float32 torch references.

Without CUDA they run in Triton's interpreter on CPU tensors (conftest sets TRITON_INTERPRET);
with CUDA the same tests run on the GPU. Unused cache slots and block 0 (which rows hold past
the blocks their tokens need, when asked to) hold NaN, so any read outside a sequence's
tokens poisons the result and fails the test. Block tables are ragged (common/block_tables.py).

The default grid covers every dtype, head layout, head size and block size at least once and
keeps CI to a minute or two; `--full-kernels` runs the whole product.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from common.block_tables import BlockTables
from kernels.activation import silu_and_mul, silu_and_mul_reference
from kernels.fused_moe import align_by_expert, fused_moe, fused_moe_reference
from kernels.kv_store import store_kv, store_kv_reference
from kernels.paged_attention import paged_decode_attention, paged_decode_attention_reference
from kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_reference
from kernels.rms_norm import rms_norm, rms_norm_reference
from kernels.rotary import apply_rotary, apply_rotary_reference
from tests.conftest import KERNEL_DEVICE

DEVICE = torch.device(KERNEL_DEVICE)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEADS = ((4, 4), (8, 2), (5, 1), (12, 4))
HEAD_DIMS = (64, 80, 128)
BLOCK_SIZES = (16, 32)
# Stated tolerances against the float32 reference. bf16 and fp16 include the rounding of the
# output (the interpreter truncates float32 -> bf16 stores: one ulp more).
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}

# Every value of each axis at least once, in varied company.
SMALL_GRID = [
    (torch.float32, (8, 2), 64, 16),
    (torch.float32, (5, 1), 80, 32),
    (torch.float16, (4, 4), 128, 16),
    (torch.float16, (12, 4), 64, 32),
    (torch.bfloat16, (12, 4), 128, 32),
    (torch.bfloat16, (8, 2), 80, 16),
]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" in metafunc.fixturenames:
        full = metafunc.config.getoption("--full-kernels")
        cases = list(itertools.product(DTYPES, HEADS, HEAD_DIMS, BLOCK_SIZES)) if full else SMALL_GRID
        ids = [f"{str(d).removeprefix('torch.')}-q{h[0]}kv{h[1]}-d{hd}-bs{bs}" for d, h, hd, bs in cases]
        metafunc.parametrize("case", cases, ids=ids)


def paged_cache(
    lens: list[int], num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, extra_blocks: int = 0
) -> tuple[torch.Tensor, torch.Tensor, BlockTables]:
    """NaN-filled caches holding random K/V for sequences of the given lengths, and their tables.

    Block ids are shuffled across sequences; block 0 is never used and each row holds
    `extra_blocks` of it after its own, so it stays all NaN, as do the unused slots of each
    last block.
    """
    g = torch.Generator().manual_seed(sum(lens) + head_dim)
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + 2
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    order = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    rows = []
    for n, nb in zip(lens, blocks_per_seq):
        ids = [order.pop() for _ in range(nb)]
        rows.append(ids + [0] * extra_blocks)
        for cache in (k_cache, v_cache):
            flat = torch.randn(nb * block_size, num_kv_heads, head_dim, generator=g).to(dtype)
            flat[n:] = float("nan")
            cache[torch.tensor(ids, dtype=torch.long)] = flat.view(nb, block_size, num_kv_heads, head_dim)
    return k_cache.to(DEVICE), v_cache.to(DEVICE), BlockTables.from_rows(rows)


def ragged(tables: BlockTables) -> tuple[torch.Tensor, torch.Tensor]:
    """(block_ids, block_offsets) on the kernels' device: what the kernels take for a table."""
    return torch.from_numpy(tables.ids).to(DEVICE), torch.from_numpy(tables.offsets).to(DEVICE)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert not got.isnan().any(), "NaN in the output: a read outside the sequence's tokens"
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=atol, rtol=rtol)


def test_decode_attention(case: tuple[torch.dtype, tuple[int, int], int, int]) -> None:
    dtype, (heads, kv_heads), head_dim, block_size = case
    lens = [1, block_size - 1, block_size, block_size + 1, 1100]
    k_cache, v_cache, tables = paged_cache(lens, kv_heads, head_dim, block_size, dtype, extra_blocks=1)
    # permute the batch as well: sequence order must not matter
    order = np.array([3, 0, 4, 2, 1])
    tables = tables.take(order)
    seq_lens = torch.tensor(lens, dtype=torch.int32)[order].to(DEVICE)
    q = torch.randn(len(lens), heads, head_dim).to(dtype).to(DEVICE)
    scale = head_dim**-0.5
    want = paged_decode_attention_reference(q, k_cache, v_cache, *ragged(tables), seq_lens, scale)
    got = paged_decode_attention(q, k_cache, v_cache, *ragged(tables), seq_lens, scale, tables.max_len)
    assert_close(got, want, dtype)


def test_decode_attention_with_more_splits_than_tokens() -> None:
    dtype = torch.float32
    lens = [1, 3, 40]
    k_cache, v_cache, tables = paged_cache(lens, 2, 64, 16, dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(3, 8, 64, device=DEVICE)
    want = paged_decode_attention_reference(q, k_cache, v_cache, *ragged(tables), seq_lens, 0.125)
    out = torch.empty_like(q)
    got = paged_decode_attention(q, k_cache, v_cache, *ragged(tables), seq_lens, 0.125, 3, out=out, num_splits=24)
    assert got is out  # written in place when `out` is given
    assert_close(got, want, dtype)


def test_prefill_attention(case: tuple[torch.dtype, tuple[int, int], int, int]) -> None:
    dtype, (heads, kv_heads), head_dim, block_size = case
    # (context already cached, query tokens): a fresh prompt, a chunk whose context is not a
    # multiple of the block size, a decode, a one-token prompt, a long chunk, a prefix-cache
    # hit on a block boundary, and an empty query.
    pairs = [(0, 37), (block_size + 3, 20), (50, 1), (0, 1), (70, 130), (2 * block_size, 9), (5, 0)]
    lens = [c + q for c, q in pairs]
    k_cache, v_cache, tables = paged_cache(lens, kv_heads, head_dim, block_size, dtype, extra_blocks=2)
    q_lens = torch.tensor([q for _, q in pairs])
    starts = torch.zeros(len(pairs) + 1, dtype=torch.int32)
    starts[1:] = q_lens.cumsum(0)
    q = torch.randn(int(starts[-1]), heads, head_dim).to(dtype).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    starts = starts.to(DEVICE)
    scale = head_dim**-0.5
    want = paged_prefill_attention_reference(q, k_cache, v_cache, *ragged(tables), starts, seq_lens, scale)
    assert_close(paged_prefill_attention(q, k_cache, v_cache, *ragged(tables), starts, seq_lens, scale), want, dtype)


# Sliding windows shorter than the sequences and not multiples of the block size (so a
# window starts mid-block), soft-capping at a cap the random scores pass, and both together.
WINDOW_SOFTCAP = [(13, 0.0), (0, 1.5), (21, 1.5)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "softcap"), WINDOW_SOFTCAP)
def test_decode_attention_sliding_window_and_softcap(dtype: torch.dtype, window: int, softcap: float) -> None:
    lens = [1, 12, 13, 14, 16, 17, 90]
    k_cache, v_cache, tables = paged_cache(lens, 2, 64, 16, dtype, extra_blocks=1)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = (3 * torch.randn(len(lens), 8, 64)).to(dtype).to(DEVICE)
    rt = ragged(tables)
    want = paged_decode_attention_reference(q, k_cache, v_cache, *rt, seq_lens, 0.125, window, softcap)
    plain = paged_decode_attention_reference(q, k_cache, v_cache, *rt, seq_lens, 0.125)
    assert (want - plain).abs().max() > 0.05  # the window and the cap change the result
    for splits in (None, 7):  # 7: the short sequences leave splits past their end empty
        got = paged_decode_attention(
            q, k_cache, v_cache, *rt, seq_lens, 0.125, 6, num_splits=splits, window=window, softcap=softcap
        )
        assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "softcap"), WINDOW_SOFTCAP)
def test_prefill_attention_sliding_window_and_softcap(dtype: torch.dtype, window: int, softcap: float) -> None:
    # A fresh prompt longer than the window, a chunk whose context the window partly covers,
    # a decode, a long chunk far past its window.
    pairs = [(0, 37), (19, 20), (50, 1), (70, 90)]
    lens = [c + n for c, n in pairs]
    k_cache, v_cache, tables = paged_cache(lens, 2, 64, 16, dtype, extra_blocks=1)
    starts = torch.zeros(len(pairs) + 1, dtype=torch.int32)
    starts[1:] = torch.tensor([n for _, n in pairs]).cumsum(0)
    q = (3 * torch.randn(int(starts[-1]), 8, 64)).to(dtype).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    starts = starts.to(DEVICE)
    rt = ragged(tables)
    want = paged_prefill_attention_reference(q, k_cache, v_cache, *rt, starts, seq_lens, 0.125, window, softcap)
    plain = paged_prefill_attention_reference(q, k_cache, v_cache, *rt, starts, seq_lens, 0.125)
    assert (want - plain).abs().max() > 0.05
    got = paged_prefill_attention(q, k_cache, v_cache, *rt, starts, seq_lens, 0.125, window=window, softcap=softcap)
    assert_close(got, want, dtype)


def test_prefill_kernel_equals_decode_kernel_on_single_tokens() -> None:
    lens = [5, 17, 33]
    k_cache, v_cache, tables = paged_cache(lens, 2, 64, 16, torch.float32)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(3, 4, 64, device=DEVICE)
    starts = torch.arange(4, dtype=torch.int32, device=DEVICE)
    a = paged_prefill_attention(q, k_cache, v_cache, *ragged(tables), starts, seq_lens, 0.125)
    b = paged_decode_attention(q, k_cache, v_cache, *ragged(tables), seq_lens, 0.125, tables.max_len)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_one_row_much_longer_than_the_others() -> None:
    """Rows of 1, 40 and 3 blocks of shuffled ids: each row as long as its own sequence needs
    (44 ids, not 3 x 40), and both kernels find every row where its offsets say, not at a
    multiple of a width."""
    block = 16
    lens = [40 * block - 5, 1 * block, 3 * block - 7]  # 40, 1 and 3 blocks; the long row first
    k_cache, v_cache, tables = paged_cache(lens, 2, 64, block, torch.float32)
    tables = tables.take(np.array([1, 0, 2]))  # the long row in the middle: 1, 40, 3 blocks
    lens = [lens[1], lens[0], lens[2]]
    assert tables.lens.tolist() == [1, 40, 3] and tables.ids.size == 44
    ids, offsets = ragged(tables)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(3, 4, 64, device=DEVICE)
    want = paged_decode_attention_reference(q, k_cache, v_cache, ids, offsets, seq_lens, 0.125)
    for splits in (None, 5):  # 5: the long row spread over splits, the short ones mostly empty
        got = paged_decode_attention(q, k_cache, v_cache, ids, offsets, seq_lens, 0.125, 40, num_splits=splits)
        assert_close(got, want, torch.float32)
    # Prefill: a whole one-block prompt, a 20-token chunk at the end of the long row, a decode.
    q_lens = [lens[0], 20, 1]
    starts = torch.tensor([0, q_lens[0], q_lens[0] + 20, sum(q_lens)], dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(q_lens), 4, 64, device=DEVICE)
    want = paged_prefill_attention_reference(q, k_cache, v_cache, ids, offsets, starts, seq_lens, 0.125)
    got = paged_prefill_attention(q, k_cache, v_cache, ids, offsets, starts, seq_lens, 0.125)
    assert_close(got, want, torch.float32)


def test_align_by_expert_groups_pairs_in_padded_blocks() -> None:
    ids = torch.tensor([[0, 2], [2, 1], [0, 0]], device=DEVICE)  # pairs 0..5 choose 0, 2, 2, 1, 0, 0
    sorted_ids, block_expert = align_by_expert(ids, num_experts=4, block_m=4)
    # Expert 3 is chosen by nobody: no block of its own. (6 + 4 * 3) // 4 = 4 blocks in all,
    # the last a spare one (expert 4, padding only).
    assert block_expert.tolist() == [0, 1, 2, 4]
    assert sorted_ids.tolist() == [0, 4, 5, 6, 3, 6, 6, 6, 1, 2, 6, 6, 6, 6, 6, 6]  # 6 = padding


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(37, 8, 2), (5, 6, 3), (1, 4, 1)])
def test_fused_moe(dtype: torch.dtype, tokens: int, experts: int, top_k: int) -> None:
    """Against the float32 reference and the worker's torch path (worker_svc/layers/moe.py)."""
    from worker_svc.device.parallel import SINGLE
    from worker_svc.layers.moe import FusedMoE

    g = torch.Generator().manual_seed(tokens)
    hidden, inter = 64, 80  # an intermediate width that is not a multiple of the tiles
    x = torch.randn(tokens, hidden, generator=g).to(dtype).to(DEVICE)
    w13 = (0.1 * torch.randn(experts, 2 * inter, hidden, generator=g)).to(dtype).to(DEVICE)
    w2 = (0.1 * torch.randn(experts, hidden, inter, generator=g)).to(dtype).to(DEVICE)
    weights, ids = torch.softmax(torch.randn(tokens, experts, generator=g), -1).topk(top_k, -1)
    weights, ids = weights.to(DEVICE), ids.to(DEVICE)
    want = fused_moe_reference(x, w13, w2, weights, ids)
    assert_close(fused_moe(x, w13, w2, weights, ids), want, dtype)
    layer = FusedMoE(hidden, inter, experts, top_k, True, SINGLE, dtype)
    layer.w13.data, layer.w2.data = w13, w2
    assert_close(layer._experts(x, weights, ids), want, dtype)  # noqa: SLF001


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_skips_minus_one(dtype: torch.dtype) -> None:
    key = torch.randn(10, 2, 80).to(dtype).to(DEVICE)
    value = torch.randn(10, 2, 80).to(dtype).to(DEVICE)
    k_cache = torch.full((6, 16, 2, 80), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    slots = torch.tensor([3, 17, -1, 40, 95, 0, 16, -1, 50, 51], device=DEVICE)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    store_kv_reference(key, value, want_k, want_v, slots)
    store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache.nan_to_num(7.0), want_k.nan_to_num(7.0))
    assert torch.equal(v_cache.nan_to_num(7.0), want_v.nan_to_num(7.0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 1000])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype: torch.dtype, hidden: int, with_residual: bool) -> None:
    x = torch.randn(9, hidden).to(dtype).to(DEVICE)
    weight = torch.rand(hidden).to(dtype).to(DEVICE)
    residual = torch.randn(9, hidden).to(dtype).to(DEVICE) if with_residual else None
    out, new_residual = rms_norm(x, weight, 1e-5, residual)
    want, want_residual = rms_norm_reference(x, weight, 1e-5, residual)
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (2**-6, 2**-6)
    torch.testing.assert_close(out.float(), want.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(new_residual.float(), want_residual.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_with_llama3_scaling(dtype: torch.dtype) -> None:
    from transformers import LlamaConfig

    from worker_svc.layers.rotary import RotaryEmbedding

    config = LlamaConfig(
        hidden_size=640,
        num_attention_heads=8,
        head_dim=80,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        },
    )
    rope = RotaryEmbedding(config, 80, 4096, dtype).to(DEVICE)
    positions = torch.tensor([0, 1, 513, 4095, 7, 2048], device=DEVICE)
    q = torch.randn(6, 8, 80).to(dtype).to(DEVICE)
    k = torch.randn(6, 2, 80).to(dtype).to(DEVICE)
    want_q, want_k = apply_rotary_reference(q, k, positions, rope.cos, rope.sin)
    apply_rotary(q, k, positions, rope.cos, rope.sin)
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (2**-6, 2**-6)
    torch.testing.assert_close(q.float(), want_q.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(k.float(), want_k.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [2 * 1536, 2 * 100])
def test_silu_and_mul(dtype: torch.dtype, width: int) -> None:
    x = (torch.randn(5, width) * 4).to(dtype).to(DEVICE)
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (2**-6, 2**-6)
    torch.testing.assert_close(silu_and_mul(x).float(), silu_and_mul_reference(x).float(), atol=atol, rtol=rtol)


def test_wrappers_refuse_bad_arguments_with_the_argument_named() -> None:
    k_cache, v_cache, tables = paged_cache([5], 2, 64, 16, torch.float32)
    ids, offsets = ragged(tables)
    seq_lens = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    q = torch.randn(1, 4, 64, device=DEVICE)
    with pytest.raises(ValueError, match="^q: 3 query heads cannot be grouped"):
        paged_decode_attention(q[:, :3], k_cache, v_cache, ids, offsets, seq_lens, 0.1, 1)
    with pytest.raises(ValueError, match="^k_cache: dtype"):
        paged_decode_attention(q, k_cache.half(), v_cache.half(), ids, offsets, seq_lens, 0.1, 1)
    with pytest.raises(ValueError, match="^block_ids: dtype"):
        paged_decode_attention(q, k_cache, v_cache, ids.long(), offsets, seq_lens, 0.1, 1)
    with pytest.raises(ValueError, match="^block_ids: expected 1 dimensions"):
        paged_decode_attention(q, k_cache, v_cache, ids[None], offsets, seq_lens, 0.1, 1)
    with pytest.raises(ValueError, match="^block_offsets: dtype"):
        paged_decode_attention(q, k_cache, v_cache, ids, offsets.long(), seq_lens, 0.1, 1)
    with pytest.raises(ValueError, match="^block_offsets: has 0 rows for 1 sequences"):
        paged_decode_attention(q, k_cache, v_cache, ids, offsets[:1], seq_lens[:0], 0.1, 1)
    with pytest.raises(ValueError, match="^seq_lens: expected shape"):
        paged_decode_attention(q, k_cache, v_cache, ids, offsets, seq_lens.repeat(2), 0.1, 1)
    with pytest.raises(ValueError, match="^q: the last dimension must be contiguous"):
        paged_decode_attention(
            q.transpose(1, 2).contiguous().transpose(1, 2), k_cache, v_cache, ids, offsets, seq_lens, 0.1, 1
        )
    with pytest.raises(ValueError, match="^out: expected shape"):
        paged_decode_attention(
            q, k_cache, v_cache, ids, offsets, seq_lens, 0.1, 1, out=torch.empty(2, 4, 64, device=DEVICE)
        )
    with pytest.raises(ValueError, match="^query_start_loc: expected shape"):
        paged_prefill_attention(
            q, k_cache, v_cache, ids, offsets, torch.zeros(5, dtype=torch.int32, device=DEVICE), seq_lens, 0.1
        )
    with pytest.raises(ValueError, match="^slot_mapping: dtype"):
        store_kv(q[:, :2], q[:, :2], k_cache, v_cache, torch.zeros(1, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="^x: last dimension must be even"):
        silu_and_mul(torch.randn(2, 7, device=DEVICE))
    with pytest.raises(ValueError, match="^weight: expected shape"):
        rms_norm(torch.randn(2, 8, device=DEVICE), torch.ones(4, device=DEVICE), 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_attention_replays_inside_a_cuda_graph() -> None:
    # The caches hold 8 tokens of the first sequence: captured at 7, it grows by one on replay
    # (a decode step), while the others shrink; every length read at replay was written.
    k_cache, v_cache, tables = paged_cache([8, 300, 1025], 8, 128, 16, torch.bfloat16)
    ids, offsets = ragged(tables)
    seq_lens = torch.tensor([7, 300, 1025], dtype=torch.int32, device=DEVICE)
    q = torch.randn(3, 32, 128, device=DEVICE, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    args = (q, k_cache, v_cache, ids, offsets, seq_lens, 0.088, tables.max_len)
    paged_decode_attention(*args, out=out)  # warm-up: compile, workspace
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(*args, out=out)
    q.copy_(torch.randn_like(q))
    seq_lens.copy_(torch.tensor([8, 299, 1000], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    want = paged_decode_attention_reference(q, k_cache, v_cache, ids, offsets, seq_lens, 0.088)
    assert_close(out, want, torch.bfloat16)
