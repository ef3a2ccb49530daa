"""Causal attention of query chunks over the paged KV cache: prefill, chunks and decode mixed.

Sequence i brings q_len_i query tokens, rows start_i .. end_i - 1 of q, which are the last
q_len_i of its seq_lens[i] tokens (its KV, this step's included, is in the cache):

    positions   0 ............ ctx-1 | ctx ........ seq_len-1      ctx = seq_len - q_len
                cached earlier       | this step's queries
    query r (position ctx + r) attends to positions 0 .. ctx + r
    (with a sliding window of W > 0: to positions ctx + r - W + 1 .. ctx + r)

That one rule serves a fresh prompt (ctx = 0), a later chunk of a long prompt, a prompt whose
prefix came from the prefix cache, and decode (q_len = 1).

The rows come as query_start_loc [seqs + 1] (sequences back to back: end_i = start_{i+1}) or
as spans [2, seqs] (starts, then ends): a subset of a step's sequences, in order, over the
step's whole q, so that a mixed step's decodes can go to the decode kernel without the
prompt chunks' q being copied out. Either way the kernel reads end_i `ends_at` entries after
start_i, from one int32 pointer.

    grid = (q.shape[0] // TILE_M + num_seqs, num_heads)

Query tiles never straddle two sequences: sequence i owns tiles starting at
start_i // TILE_M + i, and a program finds its sequence by binary search over the starts, so
the grid depends on tensor shapes only (no host read of the lengths). Starts ascend and
end_i <= start_{i+1}, so rows between the spans only leave tiles that no sequence fills.
Programs past the end of their sequence's tiles do nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention_tile import attend_tile, load_kv_tile
from kernels.checks import (
    Launch,
    check_out,
    check_paged_attention,
    check_shape,
    check_tensor,
    dot_precision,
    native_dot,
    pow2,
)


def prefill_launch(head_dim: int, dtype: torch.dtype, on_gpu: bool) -> Launch:
    """Query rows per program, key tokens per iteration, warps and pipeline depth.

    Chosen so that no configuration spills registers on sm_90 (benchmarks/kernel_resources.py
    measures them; tests/test_kernel_resources.py holds head_dim 64 and 128 to 0 spills):

    - 16-bit: 128-row tiles over 8 warps (two warpgroups of wgmma) keep the tensor cores busy
      and share each K/V tile between 128 queries. The float32 accumulator, [128, head_dim]
      over 256 threads, is what fills the registers: at head_dim 256 the key tile halves.
    - float32 stays exact ("ieee"), so its dots run on FMA units with both operands in
      registers: 64-row tiles and 32 keys (16 at head_dim 256).
    - 3 stages: Triton's pipeliner issues the block-table reads and the K/V tiles of the
      coming iterations ahead, as cp.async copies into shared memory, while the current
      tile is computed (the benchmark's cp.async column).

    The interpreter is faster with 64-row tiles and has no pipeline.
    """
    if not on_gpu:
        return Launch(rows=64, keys=64, num_warps=4, num_stages=1)
    wide = pow2(head_dim, 16) > 128
    if dtype == torch.float32:
        return Launch(rows=64, keys=16 if wide else 32, num_warps=8, num_stages=3)
    return Launch(rows=128, keys=32 if wide else 64, num_warps=8, num_stages=3)


# The number of sequences and where the ends are (ends_at: 1 back to back, the span count for
# spans) follow the batch: not specialised (Triton would compile a variant for 1 and for
# multiples of 16), so every step of a model runs one compiled kernel.
@triton.jit(do_not_specialize=["num_seqs", "ends_at"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_ids_ptr,
    block_offsets_ptr,
    query_start_ptr,
    seq_lens_ptr,
    out_ptr,
    scale,
    softcap,
    window,
    num_seqs,
    ends_at,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_M: tl.constexpr,
    TILE_N: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP

    # Binary search: the last sequence whose first tile index is <= tile.
    lo = num_seqs * 0  # an int32 tensor from the start: loop-carried values keep one type
    hi = num_seqs - 1
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2  # not (lo + hi + 1) // 2: that sum passes int32 first
        first_tile = tl.load(query_start_ptr + mid) // TILE_M + mid
        lo = tl.where(first_tile <= tile, mid, lo)
        hi = tl.where(first_tile <= tile, hi, mid - 1)
    seq = lo
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + ends_at + seq) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len
    row0 = (tile - (q_start // TILE_M + seq)) * TILE_M
    # Token indices fit int32 (kernels/limits.py), token * stride does not: the tile's first
    # row is offset in int64, rows within the tile (TILE_M * stride) in int32.
    token0 = q_start.to(tl.int64) + row0
    q_tile_ptr = q_ptr + token0 * stride_qt + head * stride_qh
    out_tile_ptr = out_ptr + token0 * stride_ot + head * stride_oh
    # The sequence's row of the ragged tables; int64, as the ids before it pass 2^31.
    table_ptr = block_ids_ptr + tl.load(block_offsets_ptr + seq).to(tl.int64)

    offs_m = row0 + tl.arange(0, TILE_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_n = tl.arange(0, TILE_N)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    offs_r = tl.arange(0, TILE_M)
    q = tl.load(
        q_tile_ptr + offs_r[:, None] * stride_qt + offs_d[None, :], mask=m_mask[:, None] & d_mask[None, :], other=0.0
    )  # [TILE_M, HEAD_DIM_PAD]
    if not NATIVE_DOT:
        q = q.to(tl.float32)
    q_pos = ctx + offs_m  # position of each query row

    # Keys up to the last valid row's position; nothing at all when this tile is empty.
    last_row = tl.minimum(row0 + TILE_M, q_len) - 1
    kv_end = tl.where(row0 < q_len, ctx + last_row + 1, 0)
    # From the first key the tile's first row still sees through its window (0 without one).
    kv_begin = tl.where(window > 0, tl.maximum(ctx + row0 - window + 1, 0), 0)

    m = tl.full([TILE_M], float("-inf"), tl.float32)
    l = tl.zeros([TILE_M], tl.float32)
    acc = tl.zeros([TILE_M, HEAD_DIM_PAD], tl.float32)
    for start in range(kv_begin, kv_end, TILE_N):
        tok = start + offs_n
        t_mask = tok < kv_end
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
        visible = (tok[None, :] <= q_pos[:, None]) & t_mask[None, :] & m_mask[:, None]
        if window > 0:
            visible = visible & (q_pos[:, None] - tok[None, :] < window)
        m, l, acc = attend_tile(
            q, k, v, visible, m, l, acc, scale, softcap, DOT_PRECISION=DOT_PRECISION, SOFTCAP=SOFTCAP
        )

    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(
        out_tile_ptr + offs_r[:, None] * stride_ot + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def _check_query_rows(query_start_loc: torch.Tensor, num_seqs: int, device: torch.device) -> int:
    """How many entries after a sequence's start its end is (the kernel's ends_at)."""
    spans = isinstance(query_start_loc, torch.Tensor) and query_start_loc.dim() == 2
    check_tensor("query_start_loc", query_start_loc, 2 if spans else 1, (torch.int32,), device=device)
    if not spans:
        check_shape("query_start_loc", query_start_loc, (num_seqs + 1,))
        return 1
    check_shape("query_start_loc", query_start_loc, (2, num_seqs))
    return query_start_loc.stride(0)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    block_offsets: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """q: [total_query_tokens, num_heads, head_dim] -> same shape (see the module docstring).

    Sequence i's j-th block is block_ids[block_offsets[i] + j] (ragged tables, int32 [total]
    and [num_seqs + 1]: the offsets say how many sequences there are). `query_start_loc`:
    int32 [num_seqs + 1], or spans int32 [2, num_seqs] (first rows, then ends, ascending and
    disjoint); with spans only the rows they cover are written in `out`.
    `window` > 0: each query sees its last `window` positions; `softcap` > 0: scores (after
    `scale`) become softcap * tanh(score / softcap)."""
    num_heads, num_kv_heads = check_paged_attention(q, k_cache, v_cache, block_ids, block_offsets, seq_lens)
    total, _, head_dim = q.shape
    num_seqs = block_offsets.shape[0] - 1
    ends_at = _check_query_rows(query_start_loc, num_seqs, q.device)
    out = check_out(out, q)
    if total == 0 or num_seqs == 0:
        return out
    launch = prefill_launch(head_dim, q.dtype, q.is_cuda)
    grid = (total // launch.rows + num_seqs, num_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_ids,
        block_offsets,
        query_start_loc,
        seq_lens,
        out,
        scale,
        softcap or 1.0,
        window,
        num_seqs,
        ends_at,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=pow2(head_dim, 16),
        BLOCK_SIZE=k_cache.shape[1],
        TILE_M=launch.rows,
        TILE_N=launch.keys,
        NATIVE_DOT=native_dot(q.dtype),
        DOT_PRECISION=dot_precision(q.dtype),
        SOFTCAP=softcap > 0,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    return out


def paged_prefill_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    block_offsets: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """float32 reference with an explicit causal (and sliding-window) mask per sequence; rows
    outside the spans (when `query_start_loc` is [2, num_seqs]) are 0."""
    total, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(total, num_heads, head_dim, dtype=torch.float32, device=q.device)
    if query_start_loc.dim() == 2:
        starts, ends = query_start_loc[0], query_start_loc[1]
    else:
        starts, ends = query_start_loc[:-1], query_start_loc[1:]
    for i in range(block_offsets.shape[0] - 1):
        a, b = int(starts[i]), int(ends[i])
        n = int(seq_lens[i])
        if b == a:
            continue
        first = int(block_offsets[i])
        blocks = block_ids[first : first + -(-n // block_size)].long()
        k = (
            k_cache[blocks]
            .reshape(-1, num_kv_heads, head_dim)[:n]
            .float()
            .repeat_interleave(num_heads // num_kv_heads, 1)
        )
        v = (
            v_cache[blocks]
            .reshape(-1, num_kv_heads, head_dim)[:n]
            .float()
            .repeat_interleave(num_heads // num_kv_heads, 1)
        )
        pos = torch.arange(n - (b - a), n, device=q.device)
        keys = torch.arange(n, device=q.device)
        visible = keys[None, :] <= pos[:, None]  # [q, n]
        if window:
            visible &= pos[:, None] - keys[None, :] < window
        scores = torch.einsum("qhd,nhd->hqn", q[a:b].float(), k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~visible[None], float("-inf"))
        out[a:b] = torch.einsum("hqn,nhd->qhd", torch.softmax(scores, dim=-1), v)
    return out
