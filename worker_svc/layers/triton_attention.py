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

from common.block_tables import BlockTables
from kernels.kv_store import store_kv
from kernels.paged_attention import paged_decode_attention
from kernels.prefill_attention import paged_prefill_attention
from worker_svc.layers.attention import PagedAttentionBackend


@dataclass(frozen=True)
class DecodeRows:
    """A mixed step's single-token rows, for the decode kernel."""

    block_ids: torch.Tensor  # int32 [their blocks], ragged rows (common/block_tables.py) ...
    block_offsets: torch.Tensor  # int32 [decodes + 1] ... each cut to the blocks its seq_len spans
    max_blocks: int  # the longest of those rows
    seq_lens: torch.Tensor  # int32 [decodes]
    first: int  # their q rows are first .. first + decodes - 1 ...
    rows: torch.Tensor | None = None  # ... unless given here: int64 [decodes], when not consecutive


@dataclass(frozen=True)
class TritonAttentionMetadata:
    """The tables, seq_lens and query_start_loc describe the sequences the step's one main
    kernel runs over: every sequence (the decode kernel when `decode_only`, else the prefill
    kernel), or in a mixed step only its multi-token ones, beside `decodes`."""

    slot_mapping: torch.Tensor  # int64 [tokens], -1 = do not store
    block_ids: torch.Tensor  # int32 [total blocks]: row after row (common/block_tables.py)
    block_offsets: torch.Tensor  # int32 [seqs + 1]: row i is block_ids[o[i]:o[i+1]]
    max_blocks: int  # the longest row (at least what any seq_len spans): bounds the decode splits
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
        block_tables: BlockTables,
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
                block_ids=t(block_tables.ids, torch.int32),
                block_offsets=t(block_tables.offsets, torch.int32),
                max_blocks=block_tables.max_len,
                seq_lens=t(seq_lens, torch.int32),
                query_start_loc=t(starts, torch.int32),
                decode_only=decode_only,
            )

        needed = -(-seq_lens // block_size)  # [seqs] the blocks the kernels read of each row

        def rows(seqs: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, int]:
            # Cut to the blocks these sequences read: the decode split heuristic bounds its
            # splits by the longest row, which a long chunk beside them would otherwise set.
            sub = block_tables.take(seqs, needed[seqs])
            return t(sub.ids, torch.int32), t(sub.offsets, torch.int32), sub.max_len

        dec = np.flatnonzero(is_decode)
        q_rows = starts[dec]
        consecutive = int(q_rows[-1]) - int(q_rows[0]) == len(q_rows) - 1
        pre = np.flatnonzero(query_lens > 1)  # empty queries (if any) need neither kernel
        spans = np.stack([starts[pre], starts[pre + 1]]).astype(np.int32)  # [2, prefills]
        pre_ids, pre_offsets, pre_max = rows(pre)
        dec_ids, dec_offsets, dec_max = rows(dec)
        return TritonAttentionMetadata(
            slot_mapping=slots,
            block_ids=pre_ids,
            block_offsets=pre_offsets,
            max_blocks=pre_max,
            seq_lens=t(seq_lens[pre], torch.int32),
            query_start_loc=t(spans, torch.int32),
            decode_only=False,
            decodes=DecodeRows(
                block_ids=dec_ids,
                block_offsets=dec_offsets,
                max_blocks=dec_max,
                seq_lens=t(seq_lens[dec], torch.int32),
                first=int(q_rows[0]),
                rows=None if consecutive else t(q_rows, torch.int64),
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
        tables = (meta.block_ids, meta.block_offsets)
        if meta.decode_only:
            return paged_decode_attention(
                q, k_cache, v_cache, *tables, meta.seq_lens, self.scale, meta.max_blocks, window=window, softcap=softcap
            )
        out = paged_prefill_attention(
            q,
            k_cache,
            v_cache,
            *tables,
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
        args = (k_cache, v_cache, d.block_ids, d.block_offsets, d.seq_lens, self.scale, d.max_blocks)
        if d.rows is None:
            rows = slice(d.first, d.first + d.seq_lens.shape[0])
            paged_decode_attention(q[rows], *args, out=out[rows], window=window, softcap=softcap)
            return
        decoded = paged_decode_attention(q.index_select(0, d.rows), *args, window=window, softcap=softcap)
        out.index_copy_(0, d.rows, decoded)  # [decodes, heads, head_dim] into their rows
