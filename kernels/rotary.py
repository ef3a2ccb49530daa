"""Rotary position embedding applied in place to q and k (neox style), at any positions.

For each token t at position p = positions[t] and every head, the two halves of the head rotate:

    x1, x2 = x[:d/2], x[d/2:]
    x1' = x1 * cos[p] - x2 * sin[p]
    x2' = x2 * cos[p] + x1 * sin[p]

cos and sin are [max_position, head_dim / 2] tables built once per model, so every rope
variant (linear, Llama-3, YaRN scaling) is a different table and the same kernel. One program
per token rotates all its query and key heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import FLOAT_DTYPES, check_shape, check_tensor, fail, pow2


@triton.jit
def _rotate_heads(ptr, stride_h, num_heads, cos, sin, offs_h, offs_d, HALF: tl.constexpr):
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HALF)
    first = ptr + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    num_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)  # token * stride passes 2^31 at ~350k tokens of a 6144-wide qkv row
    pos = tl.load(positions_ptr + token)
    offs_d = tl.arange(0, HALF_PAD)
    d_mask = offs_d < HALF
    cos = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cos + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, num_heads, cos, sin, tl.arange(0, HEADS_PAD), offs_d, HALF)
    _rotate_heads(
        k_ptr + token * stride_kt, stride_kh, num_kv_heads, cos, sin, tl.arange(0, KV_HEADS_PAD), offs_d, HALF
    )


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim], rotated in place.

    positions: int64 [tokens]; cos, sin: [max_position, head_dim / 2].
    """
    check_tensor("q", q, 3, FLOAT_DTYPES)
    tokens, num_heads, head_dim = q.shape
    check_tensor("k", k, 3, (q.dtype,), device=q.device)
    if k.shape[0] != tokens or k.shape[2] != head_dim:
        fail("k", f"expected [{tokens}, kv_heads, {head_dim}], got {tuple(k.shape)}")
    if head_dim % 2:
        fail("q", f"head_dim must be even for rotary embedding, got {head_dim}")
    check_tensor("positions", positions, 1, (torch.int64, torch.int32), device=q.device)
    check_shape("positions", positions, (tokens,))
    for name, table in (("cos", cos), ("sin", sin)):
        check_tensor(name, table, 2, FLOAT_DTYPES, device=q.device)
        if table.shape[1] != head_dim // 2:
            fail(name, f"expected [max_position, {head_dim // 2}], got {tuple(table.shape)}")
    if cos.stride(0) != sin.stride(0):
        fail("sin", "must have the same row stride as cos")
    if tokens == 0:
        return
    _rotary_kernel[(tokens,)](
        q,
        k,
        positions,
        cos,
        sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        num_heads,
        k.shape[1],
        HALF=head_dim // 2,
        HALF_PAD=pow2(head_dim // 2),
        HEADS_PAD=pow2(num_heads),
        KV_HEADS_PAD=pow2(k.shape[1]),
    )


def apply_rotary_reference(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    c = cos[positions].float().unsqueeze(1)
    s = sin[positions].float().unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)
