"""The physical KV cache: per layer one K and one V tensor of fixed-size blocks, on the device,
and a host swap pool of the same layout that holds the blocks of preempted sequences.

    k_cache[layer]: [num_blocks, block_size, num_kv_heads, head_dim]       (same for v)
    host_k[layer]:  [num_cpu_blocks, block_size, num_kv_heads, head_dim]   (same for v)

The worker only holds these tensors; which block belongs to which sequence is the
scheduler's business and arrives with every plan, as do the block moves between the pools:

    swap_out  (d, h): device block d -> host block h     a preempted sequence leaves the device
    swap_in   (h, d): host block h   -> device block d   it comes back, usually to other ids
    copy      (s, d): device block s -> device block d   copy-on-write of a shared block
"""

from __future__ import annotations

import numpy as np
import torch

from common.plan import I32
from worker_svc.device.host_copy import to_device
from worker_svc.models.shape import ModelShape

GIB = 1024**3


def bytes_per_block(shape: ModelShape, block_size: int, dtype: torch.dtype, layers: int | None = None) -> int:
    """K and V of every layer (of `layers`, a pipeline stage's count) for `block_size` tokens."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    n = shape.num_layers if layers is None else layers
    return 2 * n * block_size * shape.num_kv_heads * shape.head_dim * itemsize


def blocks_in(
    budget_bytes: float,
    shape: ModelShape,
    block_size: int,
    dtype: torch.dtype,
    layers: int | None = None,
    extra_block_bytes: int = 0,  # what each block also costs elsewhere (a draft model's cache)
) -> int:
    return max(0, int(budget_bytes // (bytes_per_block(shape, block_size, dtype, layers) + extra_block_bytes)))


class KVCache:
    def __init__(
        self,
        shape: ModelShape,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_cpu_blocks: int = 0,
        layers: int | None = None,  # a pipeline stage's; None: the model's
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(
                f"no room for the KV cache: 0 blocks of {block_size} tokens fit "
                "(raise --kv-cache-gb, or set --num-gpu-blocks)"
            )
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.block_size = block_size
        self.device = device
        layout = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
        # zeros, not empty: a stray read of an unwritten slot must give finite values.
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(layout, dtype=dtype, device=device), torch.zeros(layout, dtype=dtype, device=device))
            for _ in range(shape.num_layers if layers is None else layers)
        ]
        # Pinned on CUDA: page-locked memory is what the DMA engine copies from and to at full
        # speed, and the OS never pages it out. empty, not zeros: a host block is read only by
        # a swap-in after a swap-out wrote it, and untouched pages of a 4 GiB pool cost no RAM
        # on CPU.
        self.pinned = device.type == "cuda" and num_cpu_blocks > 0
        host_layout = (num_cpu_blocks, *layout[1:])
        self.host_layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (self._host_empty(host_layout, dtype), self._host_empty(host_layout, dtype))
            for _ in range(shape.num_layers if layers is None else layers)
        ]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)

    @property
    def host_nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.host_layers)

    def _host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=self.pinned)

    # ---- block operations: pairs are int32 [k, 2] of (src, dst), checked by the runner ----
    # Each is one gather and one scatter per layer and tensor, whatever k is. The gather makes
    # a copy first, so every source is read before any destination is written.

    def swap_out(self, pairs: I32) -> None:
        """Device blocks pairs[:, 0] -> host blocks pairs[:, 1]. Returns when the host holds them,
        so the same step may overwrite the device blocks."""
        if not len(pairs):
            return
        src, dst = self._index(pairs[:, 0], self.device), self._index(pairs[:, 1], torch.device("cpu"))
        for device_kv, host_kv in zip(self.layers, self.host_layers):
            for dev, host in zip(device_kv, host_kv):
                rows = dev.index_select(0, src)  # [k, block_size, kv_heads, head_dim]
                if self.pinned:
                    rows = self._host_empty(tuple(rows.shape), rows.dtype).copy_(rows)
                host.index_copy_(0, dst, rows)

    def swap_in(self, pairs: I32) -> None:
        """Host blocks pairs[:, 0] -> device blocks pairs[:, 1], queued before the forward pass."""
        if not len(pairs):
            return
        src, dst = self._index(pairs[:, 0], torch.device("cpu")), self._index(pairs[:, 1], self.device)
        for device_kv, host_kv in zip(self.layers, self.host_layers):
            for dev, host in zip(device_kv, host_kv):
                if self.pinned:
                    # Gathered into pinned memory so the upload can run asynchronously; the
                    # caching host allocator keeps the buffer alive until the copy is done.
                    rows = torch.index_select(
                        host, 0, src, out=self._host_empty((len(pairs), *host.shape[1:]), host.dtype)
                    )
                else:
                    rows = host.index_select(0, src)
                dev.index_copy_(0, dst, rows.to(self.device, non_blocking=self.pinned))

    def copy(self, pairs: I32) -> None:
        """Device blocks pairs[:, 0] -> device blocks pairs[:, 1]."""
        if not len(pairs):
            return
        src, dst = self._index(pairs[:, 0], self.device), self._index(pairs[:, 1], self.device)
        for device_kv in self.layers:
            for dev in device_kv:
                dev.index_copy_(0, dst, dev.index_select(0, src))

    @staticmethod
    def _index(ids: np.ndarray, device: torch.device) -> torch.Tensor:
        return to_device(ids.astype(np.int64), device)
