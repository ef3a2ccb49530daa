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
    bucket, so every graph reads views of the same memory) through pinned staging slots; the
    block tables are ragged (common/block_tables.py): a flat buffer of ids with room for
    largest bucket x `width` (the widest table a sequence can have) and offsets [bucket + 1].
    A step writes only its plan's ids and the bucket's offsets, so its upload follows the
    blocks its sequences hold, not the graphs' capacity; the ids past them keep an earlier
    step's, unread. The kernels launch with max_blocks = `width`, fixed at capture;
  - the split-K workspace (kernels/workspace.py) is reserved for every bucket before the
    first capture: a smaller bucket can take more splits, and a workspace that grew between
    captures would leave the earlier graphs reading freed memory;
  - steps with prompts, more sequences than the largest bucket or a wider table run eagerly.

The LM head and sampling stay outside the graph: which rows sample changes every step.
`--enforce-eager` turns graphs off. Capture needs CUDA; `stage` (the host-side copy into the
static buffers' layout) and the bucket choice are plain numpy, and `upload` runs on CPU too:
all three are tested there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog
import torch

from common.plan import StepPlan
from kernels import workspace
from worker_svc.device.host_copy import PinnedRing
from worker_svc.step.step_buckets import Buckets

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class StagedDecode:
    """One decode step's inputs in the graphs' layout: `bucket` rows, the plan's blocks."""

    bucket: int
    num_seqs: int
    input_ids: np.ndarray  # int64 [bucket]
    positions: np.ndarray  # int64 [bucket]
    slot_mapping: np.ndarray  # int64 [bucket], -1 on padding rows
    block_ids: np.ndarray  # int32 [the plan's blocks + padding rows]: block 0 for each padding row
    block_offsets: np.ndarray  # int32 [bucket + 1]
    seq_lens: np.ndarray  # int32 [bucket], 1 on padding rows
    query_start_loc: np.ndarray  # int32 [bucket + 1], one row each


def fits(plan: StepPlan, buckets: Buckets, width: int) -> int | None:
    """The bucket a plan's step replays in, or None when it must run eagerly."""
    n = plan.num_seqs
    if n == 0 or plan.num_tokens != n or plan.block_tables.max_len > width:
        return None
    return buckets.fit(n)


def stage(plan: StepPlan, bucket: int, width: int, block_size: int) -> StagedDecode:
    """The plan's decode step padded to `bucket` rows: each row's blocks up to its token's
    (rows the plan gives more are cut), then one block (0) for each padding row. No row may
    be longer than the graphs' `width`."""
    n = plan.num_seqs
    bt = plan.block_tables
    if bt.max_len > width:
        raise ValueError(f"block_tables: a row of {bt.max_len} blocks, more than the graphs' {width}")
    positions = plan.context_lens.astype(np.int64)  # each sequence's one token sits there
    slots = np.full(bucket, -1, np.int64)
    slots[:n] = bt.lookup(np.arange(n), positions // block_size) * block_size + positions % block_size
    needed = positions // block_size + 1
    used = bt if int(needed.sum()) == bt.ids.size else bt.take(np.arange(n), needed)  # rows hold >= needed
    total = used.ids.size
    block_ids = np.zeros(total + bucket - n, np.int32)
    block_ids[:total] = used.ids
    block_offsets = np.empty(bucket + 1, np.int32)
    block_offsets[: n + 1] = used.offsets
    block_offsets[n + 1 :] = total + np.arange(1, bucket - n + 1)
    ids = np.zeros(bucket, np.int64)
    ids[:n] = plan.input_ids
    pos = np.zeros(bucket, np.int64)
    pos[:n] = positions
    seq_lens = np.ones(bucket, np.int32)
    seq_lens[:n] = plan.context_lens + 1
    starts = np.arange(bucket + 1, dtype=np.int32)
    return StagedDecode(bucket, n, ids, pos, slots, block_ids, block_offsets, seq_lens, starts)


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
        workspace_elements: Callable[[int], int] | None = None,  # n -> a decode step's (decode_workspace)
    ) -> None:
        self.buckets, self.width, self.block_size, self.device = buckets, width, block_size, device
        self._forward, self._make_meta, self._workspace_elements = forward, make_meta, workspace_elements
        b = buckets.largest
        self._ids = torch.zeros(b, dtype=torch.int64, device=device)
        self._positions = torch.zeros(b, dtype=torch.int64, device=device)
        self._slots = torch.full((b,), -1, dtype=torch.int64, device=device)
        # Until a step is uploaded, each row is one block, 0: what capture runs on.
        self._block_ids = torch.zeros(b * width, dtype=torch.int32, device=device)
        self._block_offsets = torch.arange(b + 1, dtype=torch.int32, device=device)
        self._seq_lens = torch.ones(b, dtype=torch.int32, device=device)
        self._starts = torch.arange(b + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._keep: list[Any] = []
        # One slot per input: each is rewritten once a step, after its last upload has landed.
        self._staging = PinnedRing(slots=6)

    def _meta(self, bucket: int) -> Any:
        return self._make_meta(
            slot_mapping=self._slots[:bucket],
            # Every bucket reads the whole id buffer: a step's rows may sit anywhere in it.
            block_ids=self._block_ids,
            block_offsets=self._block_offsets[: bucket + 1],
            max_blocks=self.width,
            seq_lens=self._seq_lens[:bucket],
            query_start_loc=self._starts[: bucket + 1],
            decode_only=True,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Record every bucket's forward pass, largest first (smaller ones reuse its memory).

        Every bucket runs once before any capture (compiling its kernels and sizing the
        workspace outside a graph), after the workspace is reserved for all of them when
        `workspace_elements` says how much each takes: no capture may regrow the workspace.
        """
        order = sorted(self.buckets.sizes, reverse=True)
        if self._workspace_elements is not None:
            workspace.reserve(self.device, max(self._workspace_elements(b) for b in order))
        for bucket in order:
            self._forward(self._ids[:bucket], self._positions[:bucket], self._meta(bucket))
        torch.cuda.synchronize(self.device)
        reserved = workspace.buffer(self.device)
        pool = torch.cuda.graph_pool_handle()
        for bucket in order:
            args = (self._ids[:bucket], self._positions[:bucket], self._meta(bucket))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward(*args)
            self._graphs[bucket] = (graph, hidden)
        if workspace.buffer(self.device) is not reserved:
            raise RuntimeError("the split-K workspace grew during CUDA graph capture")
        # The graphs read the workspace where it was at capture: keep it alive even if an
        # eager step grows a new one.
        self._keep.append(reserved)
        log.info("cuda_graphs_captured", buckets=len(self._graphs), largest=self.buckets.largest, width=self.width)

    def upload(self, staged: StagedDecode) -> None:
        """Copy the staged step into the static buffers (queued): of the block ids only the
        plan's."""
        b, total = staged.bucket, staged.block_ids.shape[0]
        for buffer, values in (
            (self._ids[:b], staged.input_ids),
            (self._positions[:b], staged.positions),
            (self._slots[:b], staged.slot_mapping),
            (self._block_ids[:total], staged.block_ids),
            (self._block_offsets[: b + 1], staged.block_offsets),
            (self._seq_lens[:b], staged.seq_lens),
        ):
            self._staging.upload(values, self.device, out=buffer)

    def run(self, staged: StagedDecode) -> torch.Tensor:
        """Replay the staged step's bucket; the hidden states of its real rows [n, hidden]."""
        self.upload(staged)
        graph, hidden = self._graphs[staged.bucket]
        graph.replay()
        return hidden[: staged.num_seqs]
