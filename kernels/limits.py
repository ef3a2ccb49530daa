"""How many tokens one step may carry before an int32 index in a Triton kernel wraps.

Every offset that grows with a step's tokens times a stride is int64 in the kernels (a token's
row, a sequence's block-table row, a KV block in the cache; tests/test_kernels_compile.py
checks the compiled IR). What is still int32, and grows with the step's tokens T:

    query_start_loc     int32 [seqs + 1]; its last entry is T
    prefill tile index  program_id(0) < T // TILE_M + seqs, also computed in int32 by the
                        kernel's search for its sequence; seqs <= T (each scheduled
                        sequence brings a token), so T + T // TILE_M must fit int32, which
                        is also CUDA's limit on grid.x
    row-kernel grids    one program per token (store_kv, rotary, rms_norm, silu_and_mul):
                        T programs along grid.x

The prefill tile index binds: T + T // TILE_M <= 2^31 - 1, about 2.1e9 tokens. No model shape
moves it; the shape enters only through offsets inside one token's row or one KV block, which
stay int32 and must fit on their own (a model whose row alone passes 2^31 gets 0):

    rms_norm        the row tile, pow2(hidden_size)
    silu_and_mul    gate and up halves of a row, 2 * intermediate_size (rounded up to the tile)
    prefill q/out   TILE_M rows of the fused qkv activation, TILE_M * (heads + 2 kv_heads) * head_dim
    KV cache        one block, block_size * kv_heads * head_dim

The logits ([tokens, vocab]) are computed by torch, not by these kernels, and are not bounded here.
"""

from __future__ import annotations

import torch

from kernels.activation import BLOCK as SILU_BLOCK
from kernels.checks import pow2
from kernels.prefill_attention import prefill_launch

INT32_MAX = 2**31 - 1
MAX_BLOCK_SIZE = 128  # the largest KV block size the cache config accepts


def max_tokens_per_step(
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    block_size: int = MAX_BLOCK_SIZE,
) -> int:
    """The most tokens per step for which every int32 index in the kernels stays below 2^31.

    The shape is one rank's share under tensor parallelism or the whole model: a whole model
    gives the smaller (safe) answer.
    """
    for name, value in (
        ("hidden_size", hidden_size),
        ("num_heads", num_heads),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("intermediate_size", intermediate_size),
        ("block_size", block_size),
    ):
        if value < 1:
            raise ValueError(f"{name} must be positive, got {value}")
    # The smallest query tile any dtype uses makes the most tiles.
    tile_m = min(
        prefill_launch(head_dim, dtype, on_gpu=True).rows for dtype in (torch.float32, torch.float16, torch.bfloat16)
    )
    row_offsets = (
        pow2(hidden_size),
        2 * (-(-intermediate_size // SILU_BLOCK) * SILU_BLOCK),
        tile_m * (num_heads + 2 * num_kv_heads) * head_dim,
        block_size * num_kv_heads * head_dim,
    )
    if max(row_offsets) > INT32_MAX:
        return 0
    return _largest_tokens_with_tiles_within(INT32_MAX, tile_m)


def _largest_tokens_with_tiles_within(limit: int, tile_m: int) -> int:
    """The largest T with T + T // tile_m <= limit (the sum grows by 1 or 2 per token)."""
    tokens = limit * tile_m // (tile_m + 1)
    while tokens + 1 + (tokens + 1) // tile_m <= limit:
        tokens += 1
    while tokens + tokens // tile_m > limit:
        tokens -= 1
    return tokens
