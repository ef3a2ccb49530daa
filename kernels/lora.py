"""Batched LoRA over mixed adapters: one step's tokens, each with its own adapter slot (SGMV style).

    delta[t] = scales[s] * B[s] @ (A[s] @ x[t]),  s = token_slots[t];  nothing where s = -1
    out[t] += delta[t]   (in place: `out` is the base layer's output)

Shapes (S slots, R = max_rank, T tokens; ranks below R are zero-padded in A's rows and B's columns):

    x            [T, in]        the layer's input, of the model dtype
    a_slots      [S, R, in]     the slots' A matrices ("shrink"), same dtype
    b_slots      [S, out, R]    the slots' B matrices ("expand"), same dtype
    scales       float32 [S]    lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)) per slot
    token_slots  int32 [T]      a slot per token, -1 = the base model (nothing added)
    out          [T, out]       rows may be strided (a column slice of a fused qkv output)

API: `segments = lora_segments(token_slots, num_slots)` once per step (the sort is the same for
every layer), then `lora_shrink_expand(x, a_slots, b_slots, token_slots, scales, out, segments)`
per adapted layer; without `segments` the call sorts itself. `lora_reference` is the torch
version (grouped by slot, a loop over the slots only), which the CPU worker path uses.

Grouping: tokens are sorted by slot on the device (`kernels.fused_moe.align_by_expert`, slot -1
counted as an extra slot S) and each slot's run padded to BLOCK_M rows, so a program's rows share
one slot; blocks of slot S (the base model) and the spare blocks of the worst-case count do
nothing. Sizes follow the shapes only: no device value is read on the host, so a decode step
stays capturable in a CUDA graph. Values of token_slots outside [0, S) count as -1 (they are
never used as an index).

Two kernels: shrink, grid (blocks, splits, rank tiles), writes float32 partials
P[split, t, :] = A[s][:, k range] @ x[t, k range] (split-K over `in`: a decode step has few blocks
and A is the bulk of the bytes); expand, grid (blocks, out tiles), sums the splits, scales by the
slot's factor and adds P[t] @ B[s].T into out in float32 before one rounding to out's dtype.

Tensor parallelism: nothing assumes full sizes. A column-parallel layer passes full A and its
shard of B ([S, out / tp, R], out [T, out / tp]); a row-parallel layer passes its shard of x and
of A ([S, R, in / tp]) with full B and adds into its partial output before the all-reduce: the
delta is linear in the shrink's partial sums, so the layer's own all-reduce completes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.checks import FLOAT_DTYPES, check_shape, check_tensor, dot_precision, fail, native_dot, pow2
from kernels.fused_moe import align_by_expert
from kernels.workspace import workspace

BLOCK_M = 16  # token rows per program: tl.dot's smallest tile on a GPU
BLOCK_K = 64  # input features per shrink iteration
BLOCK_N = 64  # output features per expand program
MAX_BLOCK_R = 64  # rank columns per tile
MAX_SPLITS = 16
TARGET_PROGRAMS = 128  # about one shrink program per SM of an H100/H200


@dataclass(frozen=True)
class LoraSegments:
    """Tokens sorted by slot in BLOCK_M-row blocks (see the module docstring)."""

    sorted_ids: torch.Tensor  # int64 [blocks * BLOCK_M]: token index, or T as padding
    block_slot: torch.Tensor  # int64 [blocks]: the slot of block b; num_slots = nothing to add
    num_slots: int
    tokens: int  # T: segments of another step would index past x's rows


def lora_segments(token_slots: torch.Tensor, num_slots: int) -> LoraSegments:
    """Sorts a step's tokens by slot on the device (no host read), once for all of its layers."""
    check_tensor("token_slots", token_slots, 1, (torch.int32,))
    if num_slots < 1:
        fail("num_slots", f"must be at least 1, got {num_slots}")
    slots = token_slots.long()
    slots = torch.where((slots >= 0) & (slots < num_slots), slots, num_slots)  # the base model: slot S
    sorted_ids, block_slot = align_by_expert(slots[:, None], num_slots + 1, BLOCK_M)
    return LoraSegments(sorted_ids, block_slot, num_slots, token_slots.numel())


def shrink_tiles(blocks: int, rank: int, in_features: int) -> tuple[int, int, int]:
    """(rank tile, splits, features per split) of the shrink launch: enough programs to fill the
    GPU when a step has few blocks, at least two BLOCK_K iterations per split."""
    block_r = min(pow2(rank, 16), MAX_BLOCK_R)
    r_tiles = triton.cdiv(rank, block_r)
    chunks = triton.cdiv(in_features, BLOCK_K)
    splits = max(1, min(triton.cdiv(TARGET_PROGRAMS, blocks * r_tiles), chunks // 2, MAX_SPLITS))
    chunk_k = triton.cdiv(chunks, splits) * BLOCK_K
    return block_r, triton.cdiv(in_features, chunk_k), chunk_k


# What follows the step's token count is not specialised (Triton would compile a variant for 1
# and for multiples of 16): a step of 1 or of 16k tokens runs the variant the others run.
@triton.jit(do_not_specialize=["tokens", "chunk_k", "stride_accs"])
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    acc_ptr,
    sorted_ids_ptr,
    block_slot_ptr,
    tokens,
    num_slots,
    in_features,
    rank,
    chunk_k,
    stride_xm,
    stride_as,
    stride_ar,
    stride_accs,
    stride_accm,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    split = tl.program_id(1).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    ids = tl.load(sorted_ids_ptr + block * BLOCK_M + offs_m)  # int64 token indices, `tokens` = padding
    slot = tl.load(block_slot_ptr + block).to(tl.int64)
    base = slot >= num_slots  # the base model's tokens, or a spare block: nothing to do
    slot = tl.where(base, 0, slot)
    valid = ids < tl.where(base, 0, tokens)  # a base block's rows are all left alone
    rows = tl.where(valid, ids, 0)
    r_mask = offs_r < rank
    k_start = tl.program_id(1) * chunk_k
    k_stop = tl.where(base, k_start, tl.minimum(in_features, k_start + chunk_k))
    x_rows = x_ptr + rows[:, None] * stride_xm  # [M, 1]
    a_rows = a_ptr + slot * stride_as + offs_r[None, :].to(tl.int64) * stride_ar  # [1, R]
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < k_stop
        xt = tl.load(x_rows + kk[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)  # [M, K]
        at = tl.load(a_rows + kk[:, None], mask=k_mask[:, None] & r_mask[None, :], other=0.0)  # [K, R]
        if not NATIVE_DOT:  # the interpreter's 16-bit arithmetic is wrong: widen
            xt = xt.to(tl.float32)
            at = at.to(tl.float32)
        acc += tl.dot(xt, at, input_precision=DOT_PRECISION)
    tl.store(
        acc_ptr + split * stride_accs + ids[:, None] * stride_accm + offs_r[None, :],
        acc,
        mask=valid[:, None] & r_mask[None, :],
    )


@triton.jit(do_not_specialize=["tokens", "splits", "stride_accs"])
def _lora_expand_kernel(
    acc_ptr,
    b_ptr,
    out_ptr,
    scales_ptr,
    sorted_ids_ptr,
    block_slot_ptr,
    tokens,
    num_slots,
    out_features,
    rank,
    splits,
    stride_accs,
    stride_accm,
    stride_bs,
    stride_bn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    ids = tl.load(sorted_ids_ptr + block * BLOCK_M + offs_m)  # int64
    slot = tl.load(block_slot_ptr + block).to(tl.int64)
    base = slot >= num_slots
    slot = tl.where(base, 0, slot)
    valid = ids < tl.where(base, 0, tokens)  # a base block's rows are all left alone
    rows = tl.where(valid, ids, 0)
    n_mask = offs_n < out_features
    r_end = tl.where(base, 0, rank)
    scale = tl.load(scales_ptr + slot)
    b_rows = b_ptr + slot * stride_bs + offs_n[None, :].to(tl.int64) * stride_bn  # [1, N]
    out = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for r0 in range(0, r_end, BLOCK_R):
        rr = r0 + offs_r
        r_mask = rr < rank
        p = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
        p_ptrs = acc_ptr + rows[:, None] * stride_accm + rr[None, :]  # [M, R] of split 0
        for _ in range(0, splits):  # the shrink's split-K partials, summed in a fixed order
            p += tl.load(p_ptrs, mask=valid[:, None] & r_mask[None, :], other=0.0)
            p_ptrs += stride_accs  # stepped, never split * stride: no int32 product to wrap
        p = p * scale
        bt = tl.load(b_rows + rr[:, None], mask=r_mask[:, None] & n_mask[None, :], other=0.0)  # [R, N]
        if NATIVE_DOT:  # tensor cores: the scaled partials in B's dtype, float32 accumulation
            out += tl.dot(p.to(bt.dtype), bt, input_precision=DOT_PRECISION)
        else:
            out += tl.dot(p, bt.to(tl.float32), input_precision=DOT_PRECISION)
    ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
    mask = valid[:, None] & n_mask[None, :]
    base_out = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, (base_out + out).to(out_ptr.dtype.element_ty), mask=mask)


def check_lora(
    x: torch.Tensor,
    a_slots: torch.Tensor,
    b_slots: torch.Tensor,
    token_slots: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor | None,
    contiguous_last: bool = True,
) -> None:
    """Shapes, dtypes and devices of the module docstring; last dimensions contiguous (the kernels')."""
    check_tensor("x", x, 2, FLOAT_DTYPES, contiguous_last=contiguous_last)
    tokens, in_features = x.shape
    check_tensor("a_slots", a_slots, 3, (x.dtype,), device=x.device, contiguous_last=contiguous_last)
    num_slots, rank, a_in = a_slots.shape
    if num_slots < 1 or rank < 1:
        fail("a_slots", f"expected at least one slot and rank 1, got shape {tuple(a_slots.shape)}")
    if a_in != in_features:
        fail("a_slots", f"expected [num_slots, max_rank, {in_features}] (x's features), got {tuple(a_slots.shape)}")
    check_tensor("b_slots", b_slots, 3, (x.dtype,), device=x.device, contiguous_last=contiguous_last)
    if b_slots.shape[0] != num_slots or b_slots.shape[2] != rank:
        fail(
            "b_slots",
            f"expected [{num_slots}, out_features, {rank}] (a_slots' slots and rank), got {tuple(b_slots.shape)}",
        )
    check_tensor("token_slots", token_slots, 1, (torch.int32,), device=x.device)
    check_shape("token_slots", token_slots, (tokens,))
    check_tensor("scales", scales, 1, (torch.float32,), device=x.device)
    check_shape("scales", scales, (num_slots,))
    if out is not None:
        check_tensor("out", out, 2, (x.dtype,), device=x.device)
        check_shape("out", out, (tokens, b_slots.shape[1]))


def lora_shrink_expand(
    x: torch.Tensor,  # [T, in]
    a_slots: torch.Tensor,  # [S, R, in]
    b_slots: torch.Tensor,  # [S, out, R]
    token_slots: torch.Tensor,  # int32 [T], -1 = base model
    scales: torch.Tensor,  # float32 [S]
    out: torch.Tensor,  # [T, out], updated in place
    segments: LoraSegments | None = None,
) -> None:
    """out[t] += scales[s] * B[s] @ A[s] @ x[t] for s = token_slots[t] >= 0 (the module docstring).

    `segments` is `lora_segments(token_slots, S)`, computed once per step; without it the call
    computes it. Every tensor on x's device, last dimensions contiguous."""
    check_lora(x, a_slots, b_slots, token_slots, scales, out)
    num_slots, rank, in_features = a_slots.shape
    tokens, out_features = out.shape
    if segments is None:
        segments = lora_segments(token_slots, num_slots)
    elif segments.num_slots != num_slots or segments.sorted_ids.device != x.device:
        fail("segments", f"made for {segments.num_slots} slots on {segments.sorted_ids.device}, not {num_slots}")
    elif segments.tokens != tokens:
        fail("segments", f"made for {segments.tokens} tokens, not {tokens}")
    if tokens == 0 or out_features == 0:
        return
    blocks = segments.block_slot.numel()
    block_r, splits, chunk_k = shrink_tiles(blocks, rank, in_features)
    dot = dict(NATIVE_DOT=native_dot(x.dtype), DOT_PRECISION=dot_precision(x.dtype))
    (acc,) = workspace(x.device, splits * tokens * rank)
    acc = acc.view(splits, tokens, rank)
    if in_features:
        _lora_shrink_kernel[(blocks, splits, triton.cdiv(rank, block_r))](
            x,
            a_slots,
            acc,
            segments.sorted_ids,
            segments.block_slot,
            tokens,
            num_slots,
            in_features,
            rank,
            chunk_k,
            x.stride(0),
            a_slots.stride(0),
            a_slots.stride(1),
            acc.stride(0),
            acc.stride(1),
            BLOCK_M=BLOCK_M,
            BLOCK_R=block_r,
            BLOCK_K=BLOCK_K,
            **dot,
        )
    else:  # no input features: the delta is zero
        acc.zero_()
    _lora_expand_kernel[(blocks, triton.cdiv(out_features, BLOCK_N))](
        acc,
        b_slots,
        out,
        scales,
        segments.sorted_ids,
        segments.block_slot,
        tokens,
        num_slots,
        out_features,
        rank,
        splits,
        acc.stride(0),
        acc.stride(1),
        b_slots.stride(0),
        b_slots.stride(1),
        out.stride(0),
        BLOCK_M=BLOCK_M,
        BLOCK_R=block_r,
        BLOCK_N=BLOCK_N,
        **dot,
    )


def lora_reference(
    x: torch.Tensor, a_slots: torch.Tensor, b_slots: torch.Tensor, token_slots: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """The delta, float32 [T, out]: tokens grouped by slot, a loop over the slots only (the CPU
    path; `out.add_(delta)` applies it). Slots outside [0, S) add nothing, as in the kernel."""
    check_lora(x, a_slots, b_slots, token_slots, scales, None, contiguous_last=False)
    num_slots = a_slots.shape[0]
    delta = torch.zeros(x.shape[0], b_slots.shape[1], dtype=torch.float32, device=x.device)
    for s in range(num_slots):
        rows = (token_slots == s).nonzero().flatten()
        if rows.numel():
            shrunk = x[rows].float() @ a_slots[s].float().t()  # [n, R]
            delta[rows] = (shrunk * scales[s]) @ b_slots[s].float().t()  # [n, out]
    return delta
