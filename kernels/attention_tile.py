"""The inner loop both attention kernels share: gather a K/V tile, fold it into the softmax.

load_kv_tile   tokens `tok` of one sequence, one KV head, found through the block table:
               slot of token t = table[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE
attend_tile    one online-softmax step (running max m, running sum l, unnormalised acc), with
               the scores soft-capped first when SOFTCAP (Gemma 2: softcap * tanh(s / softcap))

Sliding windows are the callers' business: they start the key loop at the window and mask
the keys each row can no longer see.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(
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
    BLOCK_SIZE: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
):
    # One layer's cache passes 2^31 elements (e.g. 8 KV heads x 128 x 2^21 tokens), so a
    # block's offset is int64; the offset within a block (block_size x heads x head_dim) is not.
    block = tl.load(table_ptr + tok // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
    row = tok % BLOCK_SIZE
    k_rows = block * stride_kb + (row * stride_kt + kv_head * stride_kh)  # [TILE] int64
    v_rows = block * stride_vb + (row * stride_vt + kv_head * stride_vh)
    mask = t_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + k_rows[:, None] + offs_d[None, :], mask=mask, other=0.0)  # [TILE, HEAD_DIM_PAD]
    v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :], mask=mask, other=0.0)
    if not NATIVE_DOT:  # the interpreter's 16-bit arithmetic is wrong: widen at once
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def soft_cap(s, softcap):
    """softcap * tanh(s / softcap), tanh from one exp of a non-positive number (no overflow)."""
    x = s / softcap
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return softcap * tl.where(x < 0, -t, t)


@triton.jit
def attend_tile(q, k, v, visible, m, l, acc, scale, softcap, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [ROWS, TILE] float32
    if SOFTCAP:
        s = soft_cap(s, softcap)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    # Rows with nothing visible yet keep max = -inf; shift them by 0 so exp gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m - m_safe)
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l, acc
