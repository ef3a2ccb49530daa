"""Decode steps replayed from CUDA graphs, one captured per batch-size bucket.

A decode step of a small model on a GPU is mostly kernel launches: ~10 per layer, each a few
microseconds of CPU, for kernels that run for about as long. A CUDA graph records the whole
forward pass once and replays it with one launch. Graphs run fixed shapes at fixed
addresses, so:

  - a decode-only step (every sequence feeds one token) of n sequences runs in the graph of
    the smallest bucket b >= n (worker_svc/step_buckets.graph_buckets), padded: padding rows
    feed token 0 at position 0 into slot -1 (stored nowhere) and attend to one key of block 0;
    their outputs are dropped;
  - the step's inputs are copied into static buffers the graphs read (sized for the largest
    bucket, so every graph reads views of the same memory), block tables padded to the widest
    table a sequence can have;
  - steps with prompts, more sequences than the largest bucket or a wider table run eagerly.

The LM head and sampling stay outside the graph: which rows sample changes every step.
`--enforce-eager` turns graphs off. Capture needs CUDA; `stage` (the host-side copy into the
static buffers' layout) and the bucket choice are plain numpy, tested on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog
import torch

from common.plan import StepPlan
from worker_svc.step.step_buckets import Buckets

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class StagedDecode:
    """One decode step's inputs in the graphs' layout: `bucket` rows, tables `width` wide."""

    bucket: int
    num_seqs: int
    input_ids: np.ndarray  # int64 [bucket]
    positions: np.ndarray  # int64 [bucket]
    slot_mapping: np.ndarray  # int64 [bucket], -1 on padding rows
    block_tables: np.ndarray  # int32 [bucket, width], 0 past each table (never read: seq_lens)
    seq_lens: np.ndarray  # int32 [bucket], 1 on padding rows
    query_start_loc: np.ndarray  # int32 [bucket + 1], one row each


def fits(plan: StepPlan, buckets: Buckets, width: int) -> int | None:
    """The bucket a plan's step replays in, or None when it must run eagerly."""
    n = plan.num_seqs
    if n == 0 or plan.num_tokens != n or plan.block_tables.shape[1] > width:
        return None
    return buckets.fit(n)


def stage(plan: StepPlan, bucket: int, width: int, block_size: int) -> StagedDecode:
    """The plan's decode step padded to `bucket` rows and `width` table columns."""
    n = plan.num_seqs
    positions = plan.context_lens.astype(np.int64)  # each sequence's one token sits there
    tables = np.zeros((bucket, width), np.int32)
    tables[:n, : plan.block_tables.shape[1]] = np.maximum(plan.block_tables, 0)
    slots = np.full(bucket, -1, np.int64)
    slots[:n] = tables[np.arange(n), positions // block_size].astype(np.int64) * block_size + positions % block_size
    ids = np.zeros(bucket, np.int64)
    ids[:n] = plan.input_ids
    pos = np.zeros(bucket, np.int64)
    pos[:n] = positions
    seq_lens = np.ones(bucket, np.int32)
    seq_lens[:n] = plan.context_lens + 1
    return StagedDecode(bucket, n, ids, pos, slots, tables, seq_lens, np.arange(bucket + 1, dtype=np.int32))


class DecodeGraphs:
    """The captured graphs of one model and KV cache, and the buffers they read."""

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor],  # (ids, positions, meta) -> hidden
        make_meta: Callable[..., Any],  # TritonAttentionMetadata from the static tensors
        buckets: Buckets,
        width: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.buckets, self.width, self.block_size, self.device = buckets, width, block_size, device
        self._forward, self._make_meta = forward, make_meta
        b = buckets.largest
        self._ids = torch.zeros(b, dtype=torch.int64, device=device)
        self._positions = torch.zeros(b, dtype=torch.int64, device=device)
        self._slots = torch.full((b,), -1, dtype=torch.int64, device=device)
        self._tables = torch.zeros((b, width), dtype=torch.int32, device=device)
        self._seq_lens = torch.ones(b, dtype=torch.int32, device=device)
        self._starts = torch.arange(b + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._keep: list[Any] = []

    def _meta(self, bucket: int) -> Any:
        return self._make_meta(
            slot_mapping=self._slots[:bucket],
            block_tables=self._tables[:bucket],
            seq_lens=self._seq_lens[:bucket],
            query_start_loc=self._starts[: bucket + 1],
            decode_only=True,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Record every bucket's forward pass, largest first (smaller ones reuse its memory)."""
        from kernels import workspace

        pool = torch.cuda.graph_pool_handle()
        for bucket in sorted(self.buckets.sizes, reverse=True):
            args = (self._ids[:bucket], self._positions[:bucket], self._meta(bucket))
            self._forward(*args)  # warm-up: compiles kernels and sizes the workspace outside the graph
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward(*args)
            self._graphs[bucket] = (graph, hidden)
        # The graphs read the split-K workspace where it was at capture: keep it alive even if
        # an eager step grows a new one.
        self._keep.append(workspace._buffers.get(self.device))
        log.info("cuda_graphs_captured", buckets=len(self._graphs), largest=self.buckets.largest, width=self.width)

    def run(self, staged: StagedDecode) -> torch.Tensor:
        """Replay the staged step's bucket; the hidden states of its real rows [n, hidden]."""
        b = staged.bucket
        for buffer, values in (
            (self._ids, staged.input_ids),
            (self._positions, staged.positions),
            (self._slots, staged.slot_mapping),
            (self._tables, staged.block_tables),
            (self._seq_lens, staged.seq_lens),
        ):
            buffer[:b].copy_(torch.from_numpy(values), non_blocking=True)
        graph, hidden = self._graphs[b]
        graph.replay()
        return hidden[: staged.num_seqs]
