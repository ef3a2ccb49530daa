"""Mixture-of-experts feed-forward as two grouped GEMMs over tokens sorted by expert.

Each token picks `top_k` experts (the router's choice, made in torch). The (token, choice)
pairs are sorted by expert and each expert's run is padded to a multiple of BLOCK_M rows, so
that a program's rows all belong to one expert (BLOCK_M grows with the step's rows per expert,
`moe_block_m`: 16 for decode batches, up to 128 for long prefill steps):

    sorted_ids [padded]   pair index t * top_k + j, or `pairs` (past every pair) as padding
    block_expert [blocks] the expert whose rows block b holds (num_experts: a spare block, all
                          padding: the block count is the worst case, so no count is read
                          back to the host and decode stays capturable in a CUDA graph)

    grid = (blocks, cdiv(N, BLOCK_N))
    program (b, n): C[sorted_ids[b rows], n tile] = A[rows' tokens] @ W[block_expert[b]]^T

The first GEMM reads A = the hidden states (row of pair p: token p // top_k) against the
experts' fused gate/up weights [E, 2I, H]; SiLU-and-mul halves it; the second reads those
[pairs, I] rows (row of pair p: p) against the down weights [E, H, I], scales each row by its
routing weight, and the top_k rows of a token are summed. Padding rows read token 0 and are
never stored. Reference: `fused_moe_reference` (per expert, in float32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.activation import silu_and_mul
from kernels.checks import FLOAT_DTYPES, check_shape, check_tensor, dot_precision, fail, native_dot

BLOCK_M = 16  # the smallest tile: decode batches, where each expert holds a few rows
# Every tile height is a compile variant of the kernel (a worker's warm-up runs one step per
# value: moe_block_m_tokens), so there are few of them.
BLOCK_MS = (BLOCK_M, 64, 128)


def moe_block_ms() -> tuple[int, ...]:
    """The BLOCK_M values `fused_moe` can launch with, smallest first."""
    return BLOCK_MS


def moe_block_m(tokens: int, top_k: int, num_experts: int) -> int:
    """The grouped GEMMs' BLOCK_M for a step of `tokens`: the largest tile that the mean
    expert's rows (tokens * top_k / num_experts) fill at least twice, 16 below that.

    Known on the host from shapes alone (the routing's counts stay on the device). Each block
    reads its expert's weights once, so taller tiles read them fewer times and feed the tensor
    cores wider products (64-row wgmma on Hopper); an expert pads its rows to whole tiles, half
    a tile on average, which at two tiles a mean expert is about a fifth of the rows computed.
    """
    pairs = tokens * top_k
    return max((m for m in BLOCK_MS if pairs >= 2 * m * num_experts), default=BLOCK_M)


def moe_block_m_tokens(top_k: int, num_experts: int, max_tokens: int) -> dict[int, int]:
    """BLOCK_M -> the fewest tokens whose step picks it, for each value a step of up to
    `max_tokens` can pick: one warm-up step each compiles every variant."""
    found: dict[int, int] = {}
    for m in BLOCK_MS:
        tokens = 1 if m == BLOCK_M else -(-2 * m * num_experts // top_k)
        if tokens <= max_tokens and moe_block_m(tokens, top_k, num_experts) == m:
            found[m] = tokens
    return found


def _num_warps(block_m: int) -> int:
    # A 128-row tile over two warpgroups (64 rows of wgmma each), as the prefill kernel's tiles.
    return 8 if block_m >= 128 else 4


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids, block_expert) for `topk_ids` [tokens, top_k] (see the module docstring).

    Every expert gets ceil(count / block_m) blocks (none when unchosen). The sizes depend on
    the shapes only, never on the counts, so nothing is read back to the host and a decode
    step stays capturable in a CUDA graph: there are as many blocks as the worst case needs,
    (pairs + experts * (block_m - 1)) // block_m, and the blocks past the last expert's are
    marked with expert `num_experts` and hold only padding.
    """
    pairs = topk_ids.numel()
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    ends = torch.cumsum(blocks, 0)  # one past each expert's last block
    num_blocks = (pairs + num_experts * (block_m - 1)) // block_m
    block_expert = torch.searchsorted(ends, torch.arange(num_blocks, device=device), right=True)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, in token order within one
    first_pair = torch.cumsum(counts, 0) - counts  # each expert's first pair in `order`
    expert_of = flat[order]
    rank = torch.arange(pairs, device=device) - first_pair[expert_of]  # place within its expert
    sorted_ids = torch.full((num_blocks * block_m,), pairs, dtype=torch.int64, device=device)
    sorted_ids[(ends - blocks)[expert_of] * block_m + rank] = order
    return sorted_ids, block_expert


# The pair count (tokens x top_k) follows the step: not specialised, so a step of one token
# with one choice, or of a multiple of 16 pairs, runs the kernel the others run.
@triton.jit(do_not_specialize=["pairs"])
def _grouped_gemm_kernel(
    a_ptr,
    w_ptr,
    c_ptr,
    weights_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    pairs,
    num_experts,
    n,
    k,
    stride_am,
    stride_we,
    stride_wn,
    stride_cm,
    TOP_K: tl.constexpr,  # pairs per A row: top_k for the first GEMM, 1 for the second
    SCALE_ROWS: tl.constexpr,  # multiply each output row by its routing weight
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    ids = tl.load(sorted_ids_ptr + block * BLOCK_M + offs_m)  # int64 pair indices
    valid = ids < pairs
    rows = tl.where(valid, ids // TOP_K, 0)  # A rows (padding reads row 0, never stored)
    # A spare block (expert = num_experts) holds only padding: no K loop, nothing stored.
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    spare = expert >= num_experts
    expert = tl.where(spare, 0, expert)
    k_end = tl.where(spare, 0, k)
    n_mask = offs_n < n
    a_rows = a_ptr + rows[:, None] * stride_am
    w_rows = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < k
        a = tl.load(a_rows + kk[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)  # [M, K]
        w = tl.load(w_rows + kk[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [K, N]
        if not NATIVE_DOT:  # the interpreter's 16-bit arithmetic is wrong: widen
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    if SCALE_ROWS:
        acc = acc * tl.load(weights_ptr + ids, mask=valid, other=0.0)[:, None]
    tl.store(
        c_ptr + ids[:, None] * stride_cm + offs_n[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=valid[:, None] & n_mask[None, :],
    )


def _grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    top_k: int,
    row_weights: torch.Tensor | None,
    block_m: int,
) -> None:
    pairs, n = out.shape
    k = a.shape[1]
    block_n = 64 if n >= 64 else 32
    block_k = 64 if k >= 64 else 32
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a,
        w,
        out,
        row_weights if row_weights is not None else out,
        sorted_ids,
        block_expert,
        pairs,
        w.shape[0],
        n,
        k,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        TOP_K=top_k,
        SCALE_ROWS=row_weights is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        NATIVE_DOT=native_dot(a.dtype),
        DOT_PRECISION=dot_precision(a.dtype),
        num_warps=_num_warps(block_m),
    )


def fused_moe(
    x: torch.Tensor,  # [tokens, hidden]
    w13: torch.Tensor,  # [experts, 2 * inter, hidden]: gate rows, then up rows
    w2: torch.Tensor,  # [experts, hidden, inter]
    topk_weights: torch.Tensor,  # float32 [tokens, top_k]
    topk_ids: torch.Tensor,  # int [tokens, top_k]
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j]."""
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_tensor("w13", w13, 3, (x.dtype,), device=x.device)
    check_tensor("w2", w2, 3, (x.dtype,), device=x.device)
    tokens, hidden = x.shape
    experts, two_inter, _ = w13.shape
    if two_inter % 2 or w13.shape[2] != hidden:
        fail("w13", f"expected [experts, 2 * inter, {hidden}], got {tuple(w13.shape)}")
    check_shape("w2", w2, (experts, hidden, two_inter // 2))
    check_tensor("topk_ids", topk_ids, 2, (torch.int32, torch.int64), device=x.device)
    check_shape("topk_weights", topk_weights, tuple(topk_ids.shape))
    if topk_ids.shape[0] != tokens:
        fail("topk_ids", f"has {topk_ids.shape[0]} rows for {tokens} tokens")
    if not x.is_contiguous() or not w13.is_contiguous() or not w2.is_contiguous():
        fail("x", "x, w13 and w2 must be contiguous")
    top_k = topk_ids.shape[1]
    out = torch.zeros(tokens, hidden, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    block_m = moe_block_m(tokens, top_k, experts)
    sorted_ids, block_expert = align_by_expert(topk_ids, experts, block_m)
    pairs = tokens * top_k
    gate_up = torch.empty(pairs, two_inter, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, sorted_ids, block_expert, top_k, None, block_m)
    act = silu_and_mul(gate_up)  # [pairs, inter]
    down = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    _grouped_gemm(act, w2, down, sorted_ids, block_expert, 1, weights, block_m)
    return down.view(tokens, top_k, hidden).sum(1, dtype=torch.float32).to(x.dtype)


def fused_moe_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """float32, token by token and choice by choice."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = w13[e].float() @ x[t].float()
            h = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[t] += float(topk_weights[t, j]) * (w2[e].float() @ h)
    return out
