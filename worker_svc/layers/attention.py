"""Paged attention behind one interface, so the Triton kernels can replace the torch path.

A backend is two calls:
  `build_metadata(...)`  once per step, from the plan's arrays (host work, index tensors);
  `forward(q, k, v, k_cache, v_cache, meta, window, softcap)`  per layer: store this step's K/V
      into the paged cache, then attend each query token to its sequence's cached tokens,
      causally; with `window` > 0 only to its last `window` positions (itself included, as
      transformers' sliding-window mask: key position > query position - window), with
      `softcap` > 0 to scores capped as softcap * tanh(score / softcap) (Gemma 2).

Cache layout (docs/design.md section 2): k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from common.block_tables import BlockTables
from worker_svc.device import host_copy

# Up to this many KV heads the decode path spreads queries block-diagonally (see _decode).
_BLOCK_DIAGONAL_MAX_KV_HEADS = 8


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [tokens], -1 = do not store
    block_ids: torch.Tensor  # int32 [total]: the step's ragged tables' rows, one after another
    # Sequences that feed one token (decode), attended as one padded batch: the reference
    # path pads them to the widest decode (never to a prefill's width).
    decode_token_idx: torch.Tensor  # int64 [decodes] token index of each decode sequence
    decode_block_tables: torch.Tensor  # int64 [decodes, width_d]
    decode_padding: torch.Tensor  # bool [decodes, 1, width_d * block_size], True past seq_len
    # (first token, query length, context length, first block in block_ids) of every other sequence.
    prefills: tuple[tuple[int, int, int, int], ...]
    store_all: bool  # no slot is -1


def attend_prefills(
    q: torch.Tensor,  # [tokens, heads, head_dim]
    k: torch.Tensor,  # [tokens, kv_heads, head_dim], this step's
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [blocks, block_size, kv_heads, head_dim], holding this step's K/V too
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,  # int32 [total]: ragged tables' rows, one after another
    # (first token, query length, context length, first block): a row's blocks start at
    # block_ids[first block], read on the host so that slicing them waits for no device.
    prefills: tuple[tuple[int, int, int, int], ...],
    scale: float,
    out: torch.Tensor,  # [tokens, heads, head_dim], written at each prefill's rows
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """Causal attention of each multi-token query with torch's SDPA (flash attention on CPU).

    A fresh prompt attends to its own contiguous K/V; a query with cached context before it
    (a later chunk, a prefix-cache hit) gathers the blocks of its own row (as many as its
    tokens fill, whatever the other rows' lengths) and masks: query i sits at position ctx + i
    and sees positions 0 .. ctx + i (from ctx + i - window + 1 with a window).
    Soft-capped scores cannot go through SDPA: those are computed in float32 here.
    """
    kvh, d, bs = k.shape[1], k.shape[2], k_cache.shape[1]
    for start, q_len, ctx, first_block in prefills:
        qs = q[start : start + q_len].transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, d]
        # Keys from the first any query sees (a window hides the older ones), whole blocks.
        lo = max(0, ctx + 1 - window) // bs * bs if window else 0
        if ctx == 0:
            ks = k[start : start + q_len].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, q_len, d]
            vs = v[start : start + q_len].transpose(0, 1).unsqueeze(0)
        else:
            blocks = block_ids[first_block + lo // bs : first_block + -(-(ctx + q_len) // bs)].long()
            ks = (
                k_cache[blocks].view(-1, kvh, d)[: ctx + q_len - lo].transpose(0, 1).unsqueeze(0)
            )  # [1, kv_heads, n, d]
            vs = v_cache[blocks].view(-1, kvh, d)[: ctx + q_len - lo].transpose(0, 1).unsqueeze(0)
        if ctx == 0 and not window and not softcap:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        elif not window and not softcap and q.device.type == "cpu":
            o = _attend_after_context(qs, ks, vs, ctx, scale)
        else:
            positions = torch.arange(lo, ctx + q_len, device=q.device)
            behind = positions[ctx - lo :, None] - positions[None, :]  # [q_len, n]: how far each key is
            mask = (behind >= 0) & (behind < window) if window else behind >= 0
            if softcap:
                o = _softcapped_attention(qs, ks, vs, mask, scale, softcap)
            else:
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start : start + q_len] = o.squeeze(0).transpose(0, 1)


def _attend_after_context(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, ctx: int, scale: float) -> torch.Tensor:
    """[1, heads, q, d] queries at positions ctx .. ctx + q - 1 over keys [0, ctx + q): the
    cached context, which every query sees whole (no mask), and the chunk's own keys (causal),
    each through CPU flash attention, merged by their log-sum-exps. A [q, ctx + q] mask would
    grow with the context: 2 GiB for a chunk of 2,048 after a million tokens."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    heads, q_len, d = qs.shape[1], qs.shape[2], qs.shape[3]
    group = heads // ks.shape[1]
    # Without a mask any query row may sit anywhere: a KV head's query heads go as more rows.
    grouped = qs.reshape(1, ks.shape[1], group * q_len, d)
    o_ctx, lse_ctx = flash(grouped, ks[:, :, :ctx], vs[:, :, :ctx], 0.0, False, scale=scale)
    own_k = ks[:, :, ctx:].repeat_interleave(group, 1)
    own_v = vs[:, :, ctx:].repeat_interleave(group, 1)
    o_own, lse_own = flash(qs, own_k, own_v, 0.0, True, scale=scale)
    lse_ctx = lse_ctx.reshape(1, heads, q_len, 1)
    lse_own = lse_own.reshape(1, heads, q_len, 1)
    top = torch.maximum(lse_ctx, lse_own)
    w_ctx, w_own = torch.exp(lse_ctx - top), torch.exp(lse_own - top)
    merged = (o_ctx.reshape(1, heads, q_len, d).float() * w_ctx + o_own.float() * w_own) / (w_ctx + w_own)
    return merged.to(qs.dtype)


def _softcapped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float
) -> torch.Tensor:
    """[1, heads, q, d] x [1, kv_heads, n, d] -> [1, heads, q, d], scores capped with tanh."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, 1)
    v = v.float().repeat_interleave(group, 1)
    scores = q.float() @ k.transpose(-1, -2) * scale
    scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).to(q.dtype)


class PagedAttentionBackend:
    """What every backend shares: the head geometry, and where each sequence's queries start."""

    name = ""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    @staticmethod
    def query_starts(query_lens: np.ndarray) -> np.ndarray:
        """int32 [seqs + 1]: sequence i's query tokens are rows starts[i] .. starts[i+1] - 1."""
        starts = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=starts[1:])
        return starts

    def build_metadata(
        self,
        query_lens: np.ndarray,
        context_lens: np.ndarray,
        block_tables: BlockTables,
        slot_mapping: np.ndarray,
        block_size: int,
        device: torch.device,
    ) -> Any:
        """The step's attention inputs on the device, in this backend's own metadata type."""
        raise NotImplementedError

    def forward(
        self,
        q: torch.Tensor,  # [tokens, heads, head_dim]
        k: torch.Tensor,  # [tokens, kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [blocks, block_size, kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: Any,  # what build_metadata returned
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def to_device(a: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A host array of the plan as a device tensor (copied without waiting for the device)."""
        return host_copy.to_device(a, device, dtype)


class TorchPagedAttention(PagedAttentionBackend):
    """Reference paged attention in torch: K/V are read back from the paged cache."""

    name = "torch"

    def build_metadata(
        self,
        query_lens: np.ndarray,
        context_lens: np.ndarray,
        block_tables: BlockTables,
        slot_mapping: np.ndarray,
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        seq_lens = context_lens + query_lens
        starts = self.query_starts(query_lens)
        is_decode = query_lens == 1
        rows = np.flatnonzero(is_decode)
        need = -(-seq_lens[rows] // block_size)  # blocks each decode reads
        width_d = int(need.max()) if rows.size else 0
        padding = np.arange(width_d * block_size)[None, :] >= seq_lens[rows][:, None]
        first_block = block_tables.offsets
        prefills = tuple(
            (int(starts[r]), int(query_lens[r]), int(context_lens[r]), int(first_block[r]))
            for r in np.flatnonzero(~is_decode)
        )

        def t(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return self.to_device(a, dtype, device)

        return AttentionMetadata(
            slot_mapping=t(slot_mapping, torch.int64),
            block_ids=t(block_tables.ids, torch.int32),
            decode_token_idx=t(starts[rows], torch.int64),
            # the padding is block 0: gathered, then masked out by decode_padding
            decode_block_tables=t(block_tables.take(rows, need).dense(width_d, fill=0), torch.int64),
            decode_padding=t(padding[:, None, :], torch.bool),
            prefills=prefills,
            store_all=bool((slot_mapping >= 0).all()),
        )

    def forward(
        self,
        q: torch.Tensor,  # [tokens, heads, head_dim]
        k: torch.Tensor,  # [tokens, kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [blocks, block_size, kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        self._store(k, v, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        if meta.decode_token_idx.numel():
            hidden = meta.decode_padding
            if window:  # keys before the last `window` of each sequence (its length: unpadded keys)
                keys = torch.arange(hidden.shape[-1], device=hidden.device)
                hidden = hidden | (keys < (~hidden).sum(-1, keepdim=True) - window)
            decoded = self._decode(q.index_select(0, meta.decode_token_idx), k_cache, v_cache, meta, hidden, softcap)
            out.index_copy_(0, meta.decode_token_idx, decoded)
        attend_prefills(q, k, v, k_cache, v_cache, meta.block_ids, meta.prefills, self.scale, out, window, softcap)
        return out

    def _scores(self, scores: torch.Tensor, hidden: torch.Tensor, softcap: float) -> torch.Tensor:
        """float32 scores, scaled, capped and with the hidden keys at -inf."""
        scores = scores.float() * self.scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        return scores.masked_fill_(hidden, float("-inf"))

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        hidden: torch.Tensor,  # bool [b, 1, L]: keys past the end or out of the window
        softcap: float,
    ) -> torch.Tensor:
        """One query per sequence, as two batched matmuls over the gathered context.

        Whole blocks are gathered with index_select (row copies), giving K and V as
        [b, L, kv_heads * d] matrices. A per-head matmul would need each head's columns
        contiguous, i.e. a second copy of the whole context; instead the queries are spread
        block-diagonally so one matmul serves every head:

            Q' [b, heads, kv_heads * d]: row of head h holds q_h in the columns of kv head h // group
            S  = Q' @ K^T   [b, heads, L]   (zeros elsewhere contribute nothing)
            O' = P @ V      [b, heads, kv_heads * d], and head h keeps its kv head's columns

        That spends kv_heads times the (small) attention FLOPs to save a memory pass, which
        pays while kv_heads is small; with many KV heads the heads are done one by one.
        """
        b = q.shape[0]
        kvh, d = self.num_kv_heads, self.head_dim
        group = self.num_heads // kvh
        flat = meta.decode_block_tables.reshape(-1)
        keys = k_cache.index_select(0, flat).view(b, -1, kvh * d)  # [b, L, kv_heads * d]
        values = v_cache.index_select(0, flat).view(b, -1, kvh * d)
        if kvh > _BLOCK_DIAGONAL_MAX_KV_HEADS:
            return self._decode_per_head(q, keys, values, hidden, softcap)
        eye = torch.eye(kvh, dtype=q.dtype, device=q.device).view(1, kvh, 1, kvh, 1)
        spread = (q.view(b, kvh, group, 1, d) * eye).view(b, self.num_heads, kvh * d)
        scores = self._scores(torch.bmm(spread, keys.transpose(1, 2)), hidden, softcap)  # [b, heads, L]
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        wide = torch.bmm(probs, values).view(b, kvh, group, kvh, d)
        return torch.diagonal(wide, dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(b, self.num_heads, d)

    def _decode_per_head(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor, softcap: float
    ) -> torch.Tensor:
        b = q.shape[0]
        kvh, d = self.num_kv_heads, self.head_dim
        qg = q.view(b, kvh, -1, d)
        out = torch.empty_like(qg)
        for h in range(kvh):
            k_h = keys[:, :, h * d : (h + 1) * d]  # [b, L, d]
            scores = self._scores(torch.bmm(qg[:, h], k_h.transpose(1, 2)), hidden, softcap)  # [b, group, L]
            probs = torch.softmax(scores, dim=-1).to(values.dtype)
            out[:, h] = torch.bmm(probs, values[:, :, h * d : (h + 1) * d])
        return out.view(b, self.num_heads, d)

    @staticmethod
    def _store(
        k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        slots = meta.slot_mapping
        if not meta.store_all:
            keep = slots >= 0
            slots, k, v = slots[keep], k[keep], v[keep]
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)
