"""Prefill and mixed-step attention in TFLOP/s.

Prefill attention is compute-bound: held against the bf16 dense matmul peak measured here
(target >= 40 %), and against torch's causal scaled_dot_product_attention (flash attention)
on contiguous tensors. Fresh prompts of 4 x 2k and 1 x 8k, 32 query / 8 KV heads of 128.

The mixed step is what a serving step looks like under chunked prefill: one 2k-token prompt
chunk with 4k tokens of context before it, beside 63 decodes at 4k. It runs through the
worker's attention backend (TritonPagedAttention: build_metadata, then forward, which also
stores the step's K/V), as the model would call it, and so does each half alone: a mixed
step costing much more than its halves means the decode rows are served badly (one kernel
tuned for long queries walking 63 one-token queries).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np
import torch

from common.block_tables import BlockTables
from gpu_check.context import Context
from gpu_check.decode import BLOCK, HEAD_DIM, HEADS, KV_HEADS, TINY_HEADS, random_cache
from gpu_check.timing import L2Flush, matmul_peak, per_call_seconds

PROMPTS = ((4, 2048), (1, 8192))  # (sequences, length)
TINY_PROMPTS = ((2, 48),)
# (query length, context before it) of each row of the mixed step: the chunk, then decodes.
MIXED = [(2048, 4096)] + [(1, 4095)] * 63
TINY_MIXED = [(24, 32)] + [(1, 47)] * 3
CALLS = 5
TARGET = 0.4


def causal_flops(rows: list[tuple[int, int]], heads: int, head_dim: int) -> float:
    """QK^T and PV of every query over the keys it sees: query i of a row with c tokens of
    context sees c + i + 1 keys (2 FLOPs per multiply-add, two products)."""
    keys = sum(q * c + q * (q + 1) / 2 for q, c in rows)
    return 4 * heads * head_dim * keys


def run(ctx: Context) -> dict[str, Any]:
    heads, kv_heads, head_dim = TINY_HEADS if ctx.tiny else (HEADS, KV_HEADS, HEAD_DIM)
    flush = L2Flush(ctx.device)
    result: dict[str, Any] = {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
    peak = None if ctx.dry else matmul_peak(ctx.device, 128 if ctx.tiny else 8192, flush, ctx.iters)
    result["matmul_peak_flops_per_s"] = peak
    result["prompts"] = [
        _prompt_case(ctx, seqs, length, heads, kv_heads, head_dim, flush, peak)
        for seqs, length in (TINY_PROMPTS if ctx.tiny else PROMPTS)
    ]
    result["mixed"] = _mixed(ctx, heads, kv_heads, head_dim, flush)
    if not ctx.dry:
        result["target_fraction"] = TARGET
        result["target_met"] = (result["prompts"][0]["fraction_of_matmul_peak"] or 0.0) >= TARGET
    result["summary"] = _summary(result, ctx.dry)
    return result


def _prompt_case(
    ctx: Context,
    seqs: int,
    length: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    flush: L2Flush,
    peak: float | None,
) -> dict[str, Any]:
    """Fresh prompts of `length` tokens each, their K/V already in the cache (as the worker
    stores a step's K/V before attending)."""
    from kernels.prefill_attention import paged_prefill_attention

    k, v, ids, offsets = random_cache(seqs, length, kv_heads, head_dim, ctx.device)
    seq_lens = torch.full((seqs,), length, dtype=torch.int32, device=ctx.device)
    starts = torch.arange(seqs + 1, dtype=torch.int32, device=ctx.device) * length
    q = torch.randn(seqs * length, heads, head_dim, device=ctx.device, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    scale = head_dim**-0.5

    def ours() -> None:
        paged_prefill_attention(q, k, v, ids, offsets, starts, seq_lens, scale, out=out)

    case: dict[str, Any] = {
        "seqs": seqs,
        "length": length,
        "flops": causal_flops([(length, 0)] * seqs, heads, head_dim),
    }
    if ctx.dry:
        ours()
        return case
    case["ours_s"] = per_call_seconds(ours, ctx.device, flush, CALLS, ctx.iters)
    case["sdpa_contiguous_s"] = _sdpa_seconds(ctx, seqs, length, heads, kv_heads, head_dim, flush)
    case["ours_flops_per_s"] = case["flops"] / case["ours_s"]
    case["sdpa_flops_per_s"] = case["flops"] / case["sdpa_contiguous_s"]
    case["fraction_of_matmul_peak"] = case["ours_flops_per_s"] / peak if peak else None
    return case


def _sdpa_seconds(
    ctx: Context, seqs: int, length: int, heads: int, kv_heads: int, head_dim: int, flush: L2Flush
) -> float:
    qc = torch.randn(seqs, heads, length, head_dim, device=ctx.device, dtype=torch.bfloat16)
    kc = torch.randn(seqs, kv_heads, length, head_dim, device=ctx.device, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)

    def sdpa() -> None:
        torch.nn.functional.scaled_dot_product_attention(qc, kc, vc, is_causal=True, enable_gqa=True)

    return per_call_seconds(sdpa, ctx.device, flush, CALLS, ctx.iters)


def _mixed(ctx: Context, heads: int, kv_heads: int, head_dim: int, flush: L2Flush) -> dict[str, Any]:
    """The mixed step, its chunk alone and its decodes alone, through the worker's backend."""
    from worker_svc.layers.triton_attention import TritonPagedAttention

    rows = TINY_MIXED if ctx.tiny else MIXED
    tables, slots = _tables(rows)
    k_cache, v_cache, _, _ = random_cache(1, int(tables.ids.max() + 1) * BLOCK, kv_heads, head_dim, ctx.device)
    backend = TritonPagedAttention(heads, kv_heads, head_dim, head_dim**-0.5)
    tokens = sum(q for q, _ in rows)
    q = torch.randn(tokens, heads, head_dim, device=ctx.device, dtype=torch.bfloat16)
    k = torch.randn(tokens, kv_heads, head_dim, device=ctx.device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    starts = np.concatenate([[0], np.cumsum([q_len for q_len, _ in rows])])
    result: dict[str, Any] = {"rows": len(rows), "chunk": list(rows[0]), "decodes": len(rows) - 1}
    for name, first, last in (("mixed", 0, len(rows)), ("chunk_alone", 0, 1), ("decodes_alone", 1, len(rows))):
        part = rows[first:last]
        lo, hi = int(starts[first]), int(starts[last])
        query_lens = np.array([q_len for q_len, _ in part], np.int32)
        context_lens = np.array([c for _, c in part], np.int32)
        host = time.perf_counter()
        part_tables = tables.take(np.arange(first, last))
        meta = backend.build_metadata(query_lens, context_lens, part_tables, slots[lo:hi], BLOCK, ctx.device)
        host = time.perf_counter() - host
        step = functools.partial(
            backend.forward, q[lo:hi], k[lo:hi], v[lo:hi], k_cache, v_cache, meta, window=0, softcap=0.0
        )
        if ctx.dry:
            step()
            continue
        seconds = per_call_seconds(step, ctx.device, flush, CALLS, ctx.iters)
        flops = causal_flops(part, heads, head_dim)
        result[name] = {"seconds": seconds, "flops_per_s": flops / seconds, "build_metadata_s": host}
    if not ctx.dry:
        halves = result["chunk_alone"]["seconds"] + result["decodes_alone"]["seconds"]
        result["mixed_over_halves"] = result["mixed"]["seconds"] / halves
    return result


def _tables(rows: list[tuple[int, int]]) -> tuple[BlockTables, np.ndarray]:
    """Ragged block tables over disjoint shuffled blocks, each row the blocks its tokens need,
    and the slot of each fed token (int64 [tokens]): where forward stores its K/V."""
    needed = np.array([-(-(q + c) // BLOCK) for q, c in rows])
    offsets = np.zeros(len(rows) + 1, np.int32)
    np.cumsum(needed, out=offsets[1:])
    tables = BlockTables(offsets, np.random.default_rng(0).permutation(int(offsets[-1])).astype(np.int32))
    slots = []
    for i, (q, c) in enumerate(rows):
        positions = np.arange(c, c + q)
        slots.append(tables.lookup(np.full(q, i), positions // BLOCK) * BLOCK + positions % BLOCK)
    return tables, np.concatenate(slots)


def _summary(result: dict[str, Any], dry: bool) -> str:
    mixed = result["mixed"]
    if dry:
        return f"built {len(result['prompts'])} prompt cases and a mixed step of {mixed['rows']} rows"
    parts = [
        f"{c['seqs']}x{c['length']} {c['ours_flops_per_s'] / 1e12:.0f} TFLOP/s ({c['fraction_of_matmul_peak']:.0%} of peak)"
        for c in result["prompts"]
    ]
    parts.append(
        f"mixed {mixed['mixed']['flops_per_s'] / 1e12:.0f} TFLOP/s, {mixed['mixed_over_halves']:.2f}x its halves"
    )
    return ", ".join(parts)
