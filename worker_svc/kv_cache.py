"""The physical KV cache: per layer one K and one V tensor of fixed-size blocks.

    k_cache[layer]: [num_blocks, block_size, num_kv_heads, head_dim]   (same for v)

The worker only holds these tensors; which block belongs to which sequence is the
scheduler's business and arrives with every plan.
"""

from __future__ import annotations

import torch

from worker_svc.model import ModelShape

GIB = 1024**3
DEFAULT_CPU_KV_GB = 2.0


def bytes_per_block(shape: ModelShape, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for `block_size` tokens."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return 2 * shape.num_layers * block_size * shape.num_kv_heads * shape.head_dim * itemsize


def blocks_in(budget_bytes: float, shape: ModelShape, block_size: int, dtype: torch.dtype) -> int:
    return max(0, int(budget_bytes // bytes_per_block(shape, block_size, dtype)))


class KVCache:
    def __init__(self, shape: ModelShape, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        if num_blocks <= 0:
            raise ValueError(
                f"no room for the KV cache: 0 blocks of {block_size} tokens fit "
                "(raise --kv-cache-gb, or set --num-gpu-blocks)"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        layout = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
        # zeros, not empty: a stray read of an unwritten slot must give finite values.
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(layout, dtype=dtype, device=device), torch.zeros(layout, dtype=dtype, device=device))
            for _ in range(shape.num_layers)
        ]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)
