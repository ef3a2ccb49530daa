"""Decode attention as a fraction of the copy bandwidth measured on the same device.

Decode attention reads each sequence's whole K/V cache once per step and does little
arithmetic on it: memory-bound, so the copy bandwidth (bytes read + written per second) is
its ceiling. Target: >= 60 % of it at 64 x 4k (stretch 80 %). Three shapes that stress the
kernel differently, each 1 GiB of K/V in bfloat16 at 32 query / 8 KV heads of 128:
  64 x 4k    the reference batch
  256 x 1k   many short sequences: one program per (sequence, KV head) already fills the GPU
  8 x 32k    few long sequences: only the split-K partition keeps the SMs busy
each eager (back-to-back calls) and replayed from a CUDA graph (no launch cost), against
torch's scaled_dot_product_attention on contiguous copies (what a non-paged layout gets).
"""

from __future__ import annotations

from typing import Any

import torch

from gpu_check.context import Context
from gpu_check.timing import L2Flush, copy_bandwidth, per_call_seconds

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
CASES = ((64, 4096), (256, 1024), (8, 32768))  # (sequences, context)
TINY_HEADS = (4, 2, 64)
TINY_CASES = ((2, 64), (4, 32), (1, 160))
CALLS = 20  # per timed iteration: ~5 ms of work at the reference shape
TARGET, STRETCH = 0.6, 0.8


def random_cache(
    seqs: int, context: int, kv_heads: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache, block_ids, block_offsets): every sequence's blocks at shuffled places
    in the pool, as a cache looks after a while of serving (contiguous blocks would flatter the
    reads), in the kernels' ragged tables (rows of equal length here)."""
    per_seq = -(-context // BLOCK)
    blocks = seqs * per_seq
    k = torch.randn(blocks, BLOCK, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    ids = torch.randperm(blocks, device=device).to(torch.int32)
    offsets = (torch.arange(seqs + 1, device=device) * per_seq).to(torch.int32)
    return k, v, ids, offsets


def kv_bytes(seqs: int, context: int, kv_heads: int, head_dim: int) -> int:
    return 2 * seqs * context * kv_heads * head_dim * 2  # K and V, 2 bytes each


def run(ctx: Context) -> dict[str, Any]:
    heads, kv_heads, head_dim = TINY_HEADS if ctx.tiny else (HEADS, KV_HEADS, HEAD_DIM)
    flush = L2Flush(ctx.device)
    result: dict[str, Any] = {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
    copy = None if ctx.dry else copy_bandwidth(ctx.device, (1 << 20) if ctx.tiny else (1 << 30), flush, ctx.iters)
    result["copy_bytes_per_s"] = copy
    result["cases"] = [
        _case(ctx, seqs, context, heads, kv_heads, head_dim, flush, copy)
        for seqs, context in (TINY_CASES if ctx.tiny else CASES)
    ]
    if not ctx.dry:
        reference = result["cases"][0]
        best = reference.get("graph_fraction_of_copy", reference.get("eager_fraction_of_copy", 0.0))
        result["target_fraction"], result["stretch_fraction"] = TARGET, STRETCH
        result["target_met"] = best >= TARGET
    result["summary"] = _summary(result, ctx.dry)
    return result


def _case(
    ctx: Context,
    seqs: int,
    context: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    flush: L2Flush,
    copy: float | None,
) -> dict[str, Any]:
    from kernels.paged_attention import paged_decode_attention

    k, v, ids, offsets = random_cache(seqs, context, kv_heads, head_dim, ctx.device)
    seq_lens = torch.full((seqs,), context, dtype=torch.int32, device=ctx.device)
    q = torch.randn(seqs, heads, head_dim, device=ctx.device, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    scale = head_dim**-0.5

    def ours() -> None:
        paged_decode_attention(q, k, v, ids, offsets, seq_lens, scale, -(-context // BLOCK), out=out)

    case: dict[str, Any] = {"seqs": seqs, "context": context, "kv_bytes": kv_bytes(seqs, context, kv_heads, head_dim)}
    if ctx.dry:
        ours()  # one untimed call: the arguments the kernel is called with are checked
        return case
    case["eager_s"] = per_call_seconds(ours, ctx.device, flush, CALLS, ctx.iters)
    if ctx.cuda:
        case["graph_s"] = per_call_seconds(ours, ctx.device, flush, CALLS, ctx.iters, graph=True)
    case["sdpa_contiguous_s"] = _sdpa_seconds(ctx, q, seqs, context, kv_heads, head_dim, flush)
    for mode in ("eager", "graph", "sdpa_contiguous"):
        if f"{mode}_s" in case and copy:
            case[f"{mode}_fraction_of_copy"] = case["kv_bytes"] / case[f"{mode}_s"] / copy
    return case


def _sdpa_seconds(
    ctx: Context, q: torch.Tensor, seqs: int, context: int, kv_heads: int, head_dim: int, flush: L2Flush
) -> float:
    kc = torch.randn(seqs, kv_heads, context, head_dim, device=ctx.device, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    qc = q.unsqueeze(2)  # [seqs, heads, 1, head_dim]

    def sdpa() -> None:
        torch.nn.functional.scaled_dot_product_attention(qc, kc, vc, enable_gqa=True)

    return per_call_seconds(sdpa, ctx.device, flush, CALLS, ctx.iters)


def _summary(result: dict[str, Any], dry: bool) -> str:
    if dry:
        return "built " + ", ".join(f"{c['seqs']}x{c['context']}" for c in result["cases"])
    parts = []
    for c in result["cases"]:
        eager = c.get("eager_fraction_of_copy")
        graph = c.get("graph_fraction_of_copy")
        shown = "/".join(f"{f:.0%}" for f in (eager, graph) if f is not None)
        parts.append(f"{c['seqs']}x{c['context']} {shown}")
    copy = result["copy_bytes_per_s"]
    return f"of copy bw {copy / 1e12:.2f} TB/s (eager/graph): " + ", ".join(parts)
