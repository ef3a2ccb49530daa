"""Paged attention on the CPU through our C++ kernels (kernels/cpu_ops.py).

Same two calls as the torch backend (see worker_svc/layers/attention.py). Per layer: `store_kv`
writes this step's K/V into the cache; then

  - the decodes (one query token each) are read straight from the paged cache by
    `paged_attention`, in one call for the whole step, with no gathered copy;
  - every longer query (a fresh prompt, a later chunk of one, a prefix-cache hit) goes, on a
    CPU with AMX, to torch's flash attention for CPU (`attend_prefills`): its blocked AMX
    GEMMs beat a vector kernel by far once a query has many rows. Without AMX (AVX-512 or
    AVX2 only) the same kernel is 2-3x slower than ours on prompts of 32-1,024 tokens
    (bfloat16, 2-core AMD EPYC with AVX512-BF16: 0.63 against 0.21 ms for 146 tokens, 14.3
    against 8.9 ms for 1,024), so there `paged_attention` takes the prompts too, in the same
    call as the decodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from common.block_tables import BlockTables
from kernels.cpu_ops import CpuKernels
from worker_svc.device.cpu_features import cpu_has_amx
from worker_svc.layers.attention import PagedAttentionBackend, attend_prefills


@dataclass(frozen=True)
class CpuAttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [tokens], -1 = do not store
    # The plan's ragged tables as they are (common/block_tables.py): no row padded to another's width.
    block_ids: torch.Tensor  # int32 [total]
    block_offsets: torch.Tensor  # int32 [seqs + 1]: row i starts at block_ids[block_offsets[i]]
    query_start: torch.Tensor  # int32 [seqs] first query row of each sequence
    kernel_lens: torch.Tensor  # int32 [seqs] query rows paged_attention takes (0: SDPA's)
    seq_lens: torch.Tensor  # int32 [seqs] tokens in the cache after this step
    # (first token, query length, context length, first block in block_ids) of every query SDPA takes.
    prefills: tuple[tuple[int, int, int, int], ...]
    any_kernel: bool
    num_tokens: int  # the step's tokens; rows past them pad the batch (worker_svc/step/step_buckets.py)


class CpuPagedAttention(PagedAttentionBackend):
    name = "cpu"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        kernels: CpuKernels,
        sdpa_prefills: bool | None = None,
    ) -> None:
        """`sdpa_prefills`: multi-token queries through torch's SDPA (True) or our kernel
        (False); None: SDPA on a CPU with AMX (see the module docstring)."""
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.kernels = kernels
        self.sdpa_prefills = cpu_has_amx() if sdpa_prefills is None else sdpa_prefills

    def build_metadata(
        self,
        query_lens: np.ndarray,
        context_lens: np.ndarray,
        block_tables: BlockTables,
        slot_mapping: np.ndarray,
        block_size: int,
        device: torch.device,
    ) -> CpuAttentionMetadata:
        starts = self.query_starts(query_lens)[:-1]
        to_sdpa = query_lens > 1 if self.sdpa_prefills else np.zeros(len(query_lens), bool)
        kernel_lens = np.where(to_sdpa, 0, query_lens).astype(np.int32)
        offsets = np.ascontiguousarray(block_tables.offsets, dtype=np.int32)
        return CpuAttentionMetadata(
            slot_mapping=torch.from_numpy(np.ascontiguousarray(slot_mapping, dtype=np.int64)),
            block_ids=torch.from_numpy(np.ascontiguousarray(block_tables.ids, dtype=np.int32)),
            block_offsets=torch.from_numpy(offsets),
            query_start=torch.from_numpy(np.ascontiguousarray(starts, dtype=np.int32)),
            kernel_lens=torch.from_numpy(kernel_lens),
            seq_lens=torch.from_numpy((context_lens + query_lens).astype(np.int32)),
            prefills=tuple(
                (int(starts[r]), int(query_lens[r]), int(context_lens[r]), int(offsets[r]))
                for r in np.flatnonzero(to_sdpa)
            ),
            any_kernel=bool(kernel_lens.any()),
            num_tokens=int(query_lens.sum()),
        )

    def forward(
        self,
        q: torch.Tensor,  # [tokens, heads, head_dim]
        k: torch.Tensor,  # [tokens, kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [blocks, block_size, kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: CpuAttentionMetadata,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        # The runner checked the plan's block tables against the cache, each row as long as its
        # sequence, and the positions (ModelRunner.check): once a step, not once a layer.
        self.kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, bounds_checked=True)
        out = torch.empty(q.shape, dtype=q.dtype)
        out[meta.num_tokens :].zero_()  # padding rows: attended by no sequence
        if meta.any_kernel:
            self.kernels.paged_attention(
                q,
                k_cache,
                v_cache,
                meta.block_ids,
                meta.block_offsets,
                meta.query_start,
                meta.kernel_lens,
                meta.seq_lens,
                self.scale,
                out,
                window,
                softcap,
                bounds_checked=True,
            )
        if meta.prefills:
            attend_prefills(q, k, v, k_cache, v_cache, meta.block_ids, meta.prefills, self.scale, out, window, softcap)
        return out
