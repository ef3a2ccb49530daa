"""Writing this step's keys and values into the paged KV cache.

    key[t, h, :]  ->  k_cache[slot // block_size, slot % block_size, h, :]   (slot = slot_mapping[t])

A slot of -1 means "do not store" (padding tokens, or tokens whose KV already sits in the
cache). One program per (token, kv head).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import (
    FLOAT_DTYPES,
    check_cache,
    check_shape,
    check_tensor,
    fail,
    pow2,
)


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_vcb,
    stride_vct,
    stride_vch,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # Both the token's row and the slot's block (slot is int64) are offset in int64: a step's
    # keys and a layer's cache can each hold more than 2^31 elements.
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token)
    offs = tl.arange(0, HEAD_DIM_PAD)
    # The skip flag is broadcast to a vector first: the interpreter rejects a scalar-vector mask.
    mask = (offs < HEAD_DIM) & ((tl.zeros([HEAD_DIM_PAD], dtype=tl.int64) + slot) >= 0)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    k = tl.load(key_ptr + token * stride_kt + head * stride_kh + offs, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + head * stride_vh + offs, mask=mask)
    tl.store(k_cache_ptr + block * stride_kcb + offset * stride_kct + head * stride_kch + offs, k, mask=mask)
    tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vct + head * stride_vch + offs, v, mask=mask)


def store_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """key, value: [num_tokens, num_kv_heads, head_dim]; slot_mapping: int64 [num_tokens]."""
    check_tensor("key", key, 3, FLOAT_DTYPES)
    num_tokens, num_kv_heads, head_dim = key.shape
    check_tensor("value", value, 3, (key.dtype,), device=key.device)
    check_shape("value", value, tuple(key.shape))
    check_cache(k_cache, v_cache, num_kv_heads, head_dim, key.dtype)
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,), device=key.device)
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    if k_cache.device != key.device:
        fail("k_cache", f"on {k_cache.device}, key is on {key.device}")
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens, num_kv_heads)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=pow2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
    )


def store_kv_reference(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[keep]
