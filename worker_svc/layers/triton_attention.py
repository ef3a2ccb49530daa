"""Paged attention through our Triton kernels (the GPU path; on CPU only under the interpreter).

Same two calls as the torch backend (see worker_svc/layers/attention.py). Per layer: `store_kv`
writes this step's K/V into the cache, then a step made only of decodes (one query token per
sequence) runs `paged_decode_attention` (split-K, one K/V read per head group), and any step
with a longer query runs `paged_prefill_attention` over the whole mixed batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.kv_store import store_kv
from kernels.paged_attention import paged_decode_attention
from kernels.prefill_attention import paged_prefill_attention
from worker_svc.layers.attention import PagedAttentionBackend


@dataclass(frozen=True)
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [tokens], -1 = do not store
    block_tables: torch.Tensor  # int32 [seqs, width]
    seq_lens: torch.Tensor  # int32 [seqs] tokens in the cache after this step
    query_start_loc: torch.Tensor  # int32 [seqs + 1]
    decode_only: bool  # every sequence feeds exactly one token


class TritonPagedAttention(PagedAttentionBackend):
    name = "triton"

    def build_metadata(
        self,
        query_lens: np.ndarray,
        context_lens: np.ndarray,
        block_tables: np.ndarray,
        slot_mapping: np.ndarray,
        block_size: int,
        device: torch.device,
    ) -> TritonAttentionMetadata:
        starts = self.query_starts(query_lens)

        def t(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return self.to_device(a, dtype, device)

        return TritonAttentionMetadata(
            slot_mapping=t(slot_mapping, torch.int64),
            block_tables=t(block_tables, torch.int32),
            seq_lens=t(context_lens + query_lens, torch.int32),
            query_start_loc=t(starts, torch.int32),
            decode_only=bool((query_lens == 1).all()),
        )

    def forward(
        self,
        q: torch.Tensor,  # [tokens, heads, head_dim]
        k: torch.Tensor,  # [tokens, kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [blocks, block_size, kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: TritonAttentionMetadata,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.decode_only:
            return paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, self.scale, window=window, softcap=softcap
            )
        return paged_prefill_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            self.scale,
            window=window,
            softcap=softcap,
        )
