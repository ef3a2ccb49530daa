"""Paged attention through our Triton kernels (the GPU path; on CPU only under the interpreter).

Same two calls as the torch backend (see worker_svc/layers/attention.py). Per layer: `store_kv`
writes this step's K/V into the cache, then each row goes to the kernel made for it:

    decode rows (1 query token)   paged_decode_attention: one program per KV-head group, so
                                  each K/V tile is read once for the whole group
    longer rows (prompt chunks)   paged_prefill_attention: 128-row query tiles

A decode row in the prefill kernel would fill 1 of its tile's 128 rows and read K/V once per
query head; the planner mixes chunks and decodes in most steps under load. A mixed step hands
the prefill kernel its chunks as spans over the step's whole q (no copy of their rows), and
the decode kernel the decode rows: a slice of q when they are consecutive (as the planner
mostly lays them out), else gathered (one token each) and scattered back.

Which row goes where is decided in `build_metadata`, on the host from the plan's numpy arrays;
the index arrays are uploaded with the rest, so no step reads anything back from the device.
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
class DecodeRows:
    """A mixed step's single-token rows, for the decode kernel."""

    block_tables: torch.Tensor  # int32 [decodes, width]
    seq_lens: torch.Tensor  # int32 [decodes]
    first: int  # their q rows are first .. first + decodes - 1 ...
    rows: torch.Tensor | None = None  # ... unless given here: int64 [decodes], when not consecutive


@dataclass(frozen=True)
class TritonAttentionMetadata:
    """block_tables, seq_lens and query_start_loc describe the sequences the step's one main
    kernel runs over: every sequence (the decode kernel when `decode_only`, else the prefill
    kernel), or in a mixed step only its multi-token ones, beside `decodes`."""

    slot_mapping: torch.Tensor  # int64 [tokens], -1 = do not store
    block_tables: torch.Tensor  # int32 [seqs, width]
    seq_lens: torch.Tensor  # int32 [seqs] tokens in the cache after this step
    query_start_loc: torch.Tensor  # int32 [seqs + 1], or in a mixed step spans [2, seqs]
    decode_only: bool  # every sequence feeds exactly one token
    decodes: DecodeRows | None = None


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
        seq_lens = context_lens + query_lens
        is_decode = query_lens == 1
        decode_only = bool(is_decode.all())

        def t(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return self.to_device(a, dtype, device)

        slots = t(slot_mapping, torch.int64)
        if decode_only or not is_decode.any():
            return TritonAttentionMetadata(
                slot_mapping=slots,
                block_tables=t(block_tables, torch.int32),
                seq_lens=t(seq_lens, torch.int32),
                query_start_loc=t(starts, torch.int32),
                decode_only=decode_only,
            )

        def tables(seqs: np.ndarray) -> np.ndarray:
            # As wide as these sequences need: the decode split heuristic bounds its splits by
            # the table's width, which a long chunk beside them would otherwise set.
            width = min(block_tables.shape[1], max(1, -(-int(seq_lens[seqs].max()) // block_size)))
            return np.ascontiguousarray(block_tables[seqs, :width])

        dec = np.flatnonzero(is_decode)
        rows = starts[dec]
        consecutive = int(rows[-1]) - int(rows[0]) == len(rows) - 1
        pre = np.flatnonzero(query_lens > 1)  # empty queries (if any) need neither kernel
        spans = np.stack([starts[pre], starts[pre + 1]]).astype(np.int32)  # [2, prefills]
        return TritonAttentionMetadata(
            slot_mapping=slots,
            block_tables=t(tables(pre), torch.int32),
            seq_lens=t(seq_lens[pre], torch.int32),
            query_start_loc=t(spans, torch.int32),
            decode_only=False,
            decodes=DecodeRows(
                block_tables=t(tables(dec), torch.int32),
                seq_lens=t(seq_lens[dec], torch.int32),
                first=int(rows[0]),
                rows=None if consecutive else t(rows, torch.int64),
            ),
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
        out = paged_prefill_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            self.scale,
            window=window,
            softcap=softcap,
        )  # [tokens, heads, head_dim]; with decodes beside, their rows are still unwritten
        d = meta.decodes
        if d is not None:
            self._decode_rows(q, k_cache, v_cache, d, out, window, softcap)
        return out

    def _decode_rows(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        d: DecodeRows,
        out: torch.Tensor,
        window: int,
        softcap: float,
    ) -> None:
        args = (k_cache, v_cache, d.block_tables, d.seq_lens, self.scale)
        if d.rows is None:
            rows = slice(d.first, d.first + d.seq_lens.shape[0])
            paged_decode_attention(q[rows], *args, out=out[rows], window=window, softcap=softcap)
            return
        decoded = paged_decode_attention(q.index_select(0, d.rows), *args, window=window, softcap=softcap)
        out.index_copy_(0, d.rows, decoded)  # [decodes, heads, head_dim] into their rows
