"""Decode attention over the paged KV cache: one query token per sequence (flash-decoding).

Work is split three ways so that a small batch of long sequences still fills the GPU:

    grid = (num_seqs, num_kv_heads, num_splits)
    program (s, g, p): the query heads of KV group g of sequence s (read as one matrix, so each
    K/V tile is loaded once per group), against the p-th piece of the keys s can see, in
    tiles of TILE tokens (decode_launch) gathered through s's row of the ragged block table
    (block j at block_ids[block_offsets[s] + j], common/block_tables.py):

        visible  [lo, seq_len)    lo = max(0, seq_len - window) with a window, else 0
        piece    per_split = ceil((seq_len - lo) / num_splits), rounded up to whole tiles
        split p  [lo + p * per_split, min(lo + (p + 1) * per_split, seq_len))

Each sequence splits its own keys, not the table's capacity: a CUDA graph launches with
max_blocks as wide as the longest context allowed, and a short sequence in it still gets its
splits. Each program leaves an unnormalised partial result with its running max and sum; a
second kernel merges the splits (log-sum-exp weights); an empty split (max = -inf, sum = 0)
weighs nothing. The split count comes from shapes and max_blocks only, never from seq_lens
on the host: no synchronisation, and the launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels import workspace
from kernels.attention_tile import attend_tile, load_kv_tile
from kernels.checks import Launch, check_out, check_paged_attention, dot_precision, fail, native_dot, pow2


def decode_launch(head_dim: int, dtype: torch.dtype, group: int, on_gpu: bool) -> Launch:
    """The padded head group (tl.dot needs at least 16 rows), key tokens per iteration, warps
    and pipeline depth.

    Chosen so that no configuration spills registers on sm_90 (benchmarks/kernel_resources.py
    measures them): 16-bit inputs take 4 warps up to a 64 x 128 query tile (rows x head_dim),
    8 beyond. float32 stays exact ("ieee"), so its dots run on FMA units with both operands
    in registers: the larger the query tile, the more warps and the fewer keys per tile
    (a 128-head group at head_dim 256, which no model has, still spills about 200 bytes).
    3 stages: the block-table reads and K/V tiles of coming iterations are issued ahead (cp.async).
    """
    rows = pow2(group, 16)
    if not on_gpu:
        return Launch(rows=rows, keys=64, num_warps=4, num_stages=1)
    tile = rows * pow2(head_dim, 16)
    if dtype != torch.float32:
        return Launch(rows=rows, keys=64, num_warps=4 if tile <= 64 * 128 else 8, num_stages=3)
    for limit, keys, warps in ((16 * 128, 64, 4), (64 * 128, 32, 8), (128 * 128, 16, 8)):
        if tile <= limit:
            return Launch(rows=rows, keys=keys, num_warps=warps, num_stages=3)
    return Launch(rows=rows, keys=16, num_warps=16, num_stages=3)


# Triton compiles a variant per distinct specialisation of its integer arguments (== 1, a
# multiple of 16). The split count follows the batch: not specialised, one variant per model.
# A split's length follows its sequence, so it is computed here, not passed (`window` is fixed
# per layer); a whole number of tiles, its divisibility is visible to the compiler anyway.
@triton.jit(do_not_specialize=["num_splits"])
def _decode_partial_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_ids_ptr,
    block_offsets_ptr,
    seq_lens_ptr,
    acc_ptr,
    max_ptr,
    sum_ptr,
    scale,
    softcap,
    window,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    num_heads,
    num_splits,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    # int64 from the start: seq * stride_qs and the [S, H, P, D] workspace index pass 2^31 for
    # big batches of wide models; the per-sequence values below stay int32.
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # int64: the ids before a row pass 2^31 in a big batch of long sequences.
    table_ptr = block_ids_ptr + tl.load(block_offsets_ptr + seq).to(tl.int64)
    # A window (> 0) hides the keys before the last `window`: no split is spent on those.
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    per_split = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), TILE) * TILE
    start = lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_t = tl.arange(0, TILE)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [GROUP_PAD, HEAD_DIM_PAD]
    if not NATIVE_DOT:
        q = q.to(tl.float32)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    for tile_start in range(start, end, TILE):
        tok = tile_start + offs_t
        t_mask = tok < end
        k, v = load_kv_tile(
            k_cache_ptr,
            v_cache_ptr,
            table_ptr,
            tok,
            t_mask,
            kv_head,
            offs_d,
            d_mask,
            stride_kb,
            stride_kt,
            stride_kh,
            stride_vb,
            stride_vt,
            stride_vh,
            BLOCK_SIZE=BLOCK_SIZE,
            NATIVE_DOT=NATIVE_DOT,
        )
        m, l, acc = attend_tile(
            q, k, v, t_mask[None, :], m, l, acc, scale, softcap, DOT_PRECISION=DOT_PRECISION, SOFTCAP=SOFTCAP
        )

    part = (seq * num_heads + heads) * num_splits + split  # [GROUP_PAD] index into [S, H, P]
    tl.store(max_ptr + part, m, mask=g_mask)
    tl.store(sum_ptr + part, l, mask=g_mask)
    tl.store(acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_mask[:, None] & d_mask[None, :])


# The split count is not specialised (see _decode_partial_kernel); SPLITS_PAD (merge_pad) is
# a tile extent, so each of its values is a variant: decode_shapes lists a step for each.
@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    acc_ptr,
    max_ptr,
    sum_ptr,
    out_ptr,
    stride_os,
    stride_oh,
    num_heads,
    num_splits,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)  # see _decode_partial_kernel
    head = tl.program_id(1)
    offs_p = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    p_mask = offs_p < num_splits
    d_mask = offs_d < HEAD_DIM
    part = (seq * num_heads + head) * num_splits + offs_p
    m = tl.load(max_ptr + part, mask=p_mask, other=float("-inf"))
    l = tl.load(sum_ptr + part, mask=p_mask, other=0.0)
    m_all = tl.max(m, 0)
    # Empty splits carry max = -inf: exp(-inf - m_all) = 0 removes them from both sums.
    w = tl.where(l > 0, tl.exp(m - m_all), 0.0)
    acc = tl.load(
        acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=p_mask[:, None] & d_mask[None, :], other=0.0
    )
    total = tl.sum(w * l, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.cache
def _parallel_units(device: torch.device) -> int:
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


MAX_SPLITS = 64  # the merge's widest split tile (tests/compile_kernels.py compiles it)


def default_num_splits(
    num_seqs: int, num_kv_heads: int, max_blocks: int, block_size: int, tile: int, device: torch.device, window: int = 0
) -> int:
    """Splits per sequence: enough programs to fill the device twice over, at most MAX_SPLITS.

    A sequence of t tiles fills min(splits, t) of them; the rest load nothing. The one bound
    on t known without reading seq_lens is the visible range the widest row allows
    (`max_blocks`, known on the host, or the window when shorter): past it every split of every
    sequence would be empty."""
    units = _parallel_units(device)
    want = -(-units // max(1, num_seqs * num_kv_heads))
    visible = max_blocks * block_size
    if window > 0:
        visible = min(visible, window)
    tiles = -(-visible // tile)
    return max(1, min(want, tiles, MAX_SPLITS))


def merge_pad(splits: int) -> int:
    """The merge kernel's split tile (its SPLITS_PAD): one compiled variant per value."""
    return pow2(splits, 2)


# Every split tile default_num_splits (1 to MAX_SPLITS splits) can lead to, whatever the device.
MERGE_PADS = sorted({merge_pad(s) for s in range(1, MAX_SPLITS + 1)})


def decode_shapes(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    max_num_seqs: int,
    max_blocks: int,
) -> dict[int, tuple[int, int]]:
    """merge_pad -> a decode batch (num_seqs, max_blocks: its widest row) whose launch picks it,
    for every merge variant a batch of up to `max_num_seqs` and `max_blocks` can pick (the
    worker's warm-up runs each, so that no later step compiles one).

    default_num_splits is min(want(num_seqs), tiles(max_blocks)): each value is reached by one
    sequence at some width (tiles binds) or by that many at the widest row (want binds), so
    walking those two edges finds them all. A windowed layer takes min(that, tiles(window));
    merge_pad is monotone, so it picks the same tile as in the step listed for the full
    layers'. Widest first, so that a shape's table holds a block and a half where it can.
    """
    tile = decode_launch(head_dim, dtype, num_heads // num_kv_heads, device.type == "cuda").keys
    edges = [(1, w) for w in range(max_blocks, 0, -1)] + [(n, max_blocks) for n in range(2, max_num_seqs + 1)]
    shapes: dict[int, tuple[int, int]] = {}
    for n, w in edges:
        shapes.setdefault(merge_pad(default_num_splits(n, num_kv_heads, w, block_size, tile, device)), (n, w))
    return shapes


def _workspace_sizes(num_seqs: int, num_heads: int, head_dim: int, splits: int) -> tuple[int, int, int]:
    parts = num_seqs * num_heads * splits  # [S, H, P]
    return parts * head_dim, parts, parts  # acc [S, H, P, D], max, sum


def decode_workspace(
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    max_blocks: int,
) -> int:
    """Workspace elements a decode launch of this shape takes without a window (a window only
    lowers the splits). Not monotone in num_seqs: splits fall in steps, so a smaller batch can
    need more (at 132 SMs and 8 KV heads, 32 sequences x 2 splits against 40 x 1)."""
    tile = decode_launch(head_dim, dtype, num_heads // num_kv_heads, device.type == "cuda").keys
    splits = default_num_splits(num_seqs, num_kv_heads, max_blocks, block_size, tile, device)
    return workspace.elements(*_workspace_sizes(num_seqs, num_heads, head_dim, splits))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    block_offsets: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_blocks: int,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """q: [num_seqs, num_heads, head_dim] -> [num_seqs, num_heads, head_dim].

    Sequence i attends to its seq_lens[i] cached tokens (this step's included), found through
    its row of the ragged tables: block j at block_ids[block_offsets[i] + j] (int32 [total]
    and [num_seqs + 1]); with `window` > 0 to its last `window` of them only. `max_blocks`,
    the most blocks a row's seq_len spans (an upper bound will do), sizes the split count
    without reading the device. `softcap` > 0 caps the scores (after `scale`) at +-softcap
    with tanh. `num_splits` overrides the split heuristic (tests use it to force empty splits).
    """
    num_heads, num_kv_heads = check_paged_attention(q, k_cache, v_cache, block_ids, block_offsets, seq_lens)
    num_seqs, _, head_dim = q.shape
    if block_offsets.shape[0] != num_seqs + 1:
        fail("block_offsets", f"has {block_offsets.shape[0] - 1} rows for {num_seqs} sequences")
    out = check_out(out, q)
    if num_seqs == 0:
        return out
    block_size = k_cache.shape[1]
    group = num_heads // num_kv_heads
    launch = decode_launch(head_dim, q.dtype, group, q.is_cuda)
    splits = num_splits or default_num_splits(
        num_seqs, num_kv_heads, max_blocks, block_size, launch.keys, q.device, window
    )
    acc, maxes, sums = workspace.workspace(q.device, *_workspace_sizes(num_seqs, num_heads, head_dim, splits))
    _decode_partial_kernel[(num_seqs, num_kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        block_ids,
        block_offsets,
        seq_lens,
        acc,
        maxes,
        sums,
        scale,
        softcap or 1.0,
        window,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        num_heads,
        splits,
        GROUP=group,
        GROUP_PAD=launch.rows,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=pow2(head_dim, 16),
        BLOCK_SIZE=block_size,
        TILE=launch.keys,
        NATIVE_DOT=native_dot(q.dtype),
        DOT_PRECISION=dot_precision(q.dtype),
        SOFTCAP=softcap > 0,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    _decode_merge_kernel[(num_seqs, num_heads)](
        acc,
        maxes,
        sums,
        out,
        out.stride(0),
        out.stride(1),
        num_heads,
        splits,
        SPLITS_PAD=merge_pad(splits),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=pow2(head_dim, 16),
    )
    return out


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    block_offsets: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """float32 reference: gather each sequence's tokens and attend with plain softmax."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=torch.float32, device=q.device)
    for i in range(num_seqs):
        n = int(seq_lens[i])
        first = int(block_offsets[i])
        blocks = block_ids[first : first + -(-n // block_size)].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].float()  # [n, kv_heads, d]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].float()
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [n, heads, d]
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[i].float(), k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        if window:
            scores[:, : max(0, n - window)] = float("-inf")
        out[i] = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v)
    return out
