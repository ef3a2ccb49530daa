"""A step that mixes prompt chunks and decodes: each row goes to the kernel made for it.

Decode rows (one query token) go to the decode kernel, which reads each K/V tile once per
KV-head group; only the multi-token rows go to the prefill kernel, as spans over the step's
whole q. Both must give what the torch backend and the float32 references give.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_reference
from tests.test_kernels import DEVICE, assert_close, paged_cache, ragged
from worker_svc.layers import triton_attention
from worker_svc.layers.attention import TorchPagedAttention
from worker_svc.layers.triton_attention import TritonPagedAttention

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 2, 32, 16
SCALE = HEAD_DIM**-0.5

# (context already cached, query tokens) per sequence.
CONSECUTIVE = [(20, 1), (5, 1), (40, 1), (19, 20), (0, 9)]  # decodes first, as the planner lays them out
INTERLEAVED = [(20, 1), (19, 20), (40, 1), (0, 9), (3, 1), (50, 17)]  # a decode between two chunks
# Rows of 1, 3, 40 and 40 blocks: one long decode and one long chunk beside short rows.
LONG_ROWS = [(8, 1), (30, 10), (632, 1), (600, 33)]
STEPS = {"consecutive": CONSECUTIVE, "interleaved": INTERLEAVED, "long rows": LONG_ROWS}
# Windows shorter than the contexts and off block boundaries, a cap the scores pass, both.
WINDOW_SOFTCAP = [(0, 0.0), (13, 0.0), (0, 1.5), (21, 1.5)]


class Step:
    """A step's plan arrays, and K/V caches holding every token it attends to (this step's
    included: storing them again writes what is already there)."""

    def __init__(self, pairs: list[tuple[int, int]], dtype: torch.dtype = torch.float32) -> None:
        self.context = np.array([c for c, _ in pairs], np.int32)
        self.query = np.array([n for _, n in pairs], np.int32)
        lens = (self.context + self.query).tolist()
        # Unused slots and block 0 (a spare block past each row's own) hold NaN: a stray read shows.
        self.k_cache, self.v_cache, self.tables = paged_cache(
            lens, KV_HEADS, HEAD_DIM, BLOCK_SIZE, dtype, extra_blocks=1
        )
        pos = np.concatenate([np.arange(c, c + n) for c, n in pairs])
        seq = np.repeat(np.arange(len(pairs)), self.query)
        self.slots = self.tables.lookup(seq, pos // BLOCK_SIZE) * BLOCK_SIZE + pos % BLOCK_SIZE
        flat = torch.from_numpy(self.slots).to(DEVICE)
        self.k = self.k_cache.flatten(0, 1)[flat]  # [tokens, kv_heads, head_dim]
        self.v = self.v_cache.flatten(0, 1)[flat]
        g = torch.Generator().manual_seed(7)
        self.q = (3 * torch.randn(len(pos), HEADS, HEAD_DIM, generator=g)).to(dtype).to(DEVICE)

    def meta(self, backend: Any) -> Any:
        return backend.build_metadata(self.query, self.context, self.tables, self.slots, BLOCK_SIZE, DEVICE)

    def run(self, backend: Any, window: int, softcap: float, nan_free: bool = False) -> torch.Tensor:
        k_cache, v_cache = self.k_cache.clone(), self.v_cache.clone()
        if nan_free:  # the torch backend multiplies padding by a zero weight: NaN would stay
            k_cache, v_cache = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
        meta = self.meta(backend)
        return backend.forward(self.q, self.k, self.v, k_cache, v_cache, meta, window, softcap)

    def reference(self, window: int, softcap: float) -> torch.Tensor:
        starts = torch.zeros(len(self.query) + 1, dtype=torch.int32)
        starts[1:] = torch.from_numpy(self.query).cumsum(0)
        return paged_prefill_attention_reference(
            self.q,
            self.k_cache,
            self.v_cache,
            *ragged(self.tables),
            starts.to(DEVICE),
            torch.from_numpy(self.context + self.query).to(DEVICE),
            SCALE,
            window,
            softcap,
        )


@pytest.mark.parametrize("layout", list(STEPS))
@pytest.mark.parametrize(("window", "softcap"), WINDOW_SOFTCAP)
def test_a_mixed_step_equals_the_torch_backend_and_the_reference(layout: str, window: int, softcap: float) -> None:
    step = Step(STEPS[layout])
    got = step.run(TritonPagedAttention(HEADS, KV_HEADS, HEAD_DIM, SCALE), window, softcap)
    assert_close(got, step.reference(window, softcap), torch.float32)
    torch_backend = TorchPagedAttention(HEADS, KV_HEADS, HEAD_DIM, SCALE)
    assert_close(got, step.run(torch_backend, window, softcap, nan_free=True), torch.float32)


def test_a_mixed_bf16_step_equals_the_reference() -> None:
    step = Step(INTERLEAVED, torch.bfloat16)
    got = step.run(TritonPagedAttention(HEADS, KV_HEADS, HEAD_DIM, SCALE), 21, 1.5)
    assert_close(got, step.reference(21, 1.5), torch.bfloat16)


class _Spy:
    """Records what each attention kernel is launched over, and launches it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.decode: list[tuple[int, list[int]]] = []  # (q rows, seq_lens)
        self.prefill: list[tuple[int, list[int]]] = []  # (sequences, seq_lens)
        decode, prefill = triton_attention.paged_decode_attention, triton_attention.paged_prefill_attention

        def spied_decode(
            q: torch.Tensor, k_cache: Any, v_cache: Any, ids: Any, offsets: Any, seq_lens: Any, *a: Any, **kw: Any
        ) -> Any:
            self.decode.append((q.shape[0], seq_lens.tolist()))
            return decode(q, k_cache, v_cache, ids, offsets, seq_lens, *a, **kw)

        def spied_prefill(
            q: Any, k_cache: Any, v_cache: Any, ids: Any, offsets: Any, starts: Any, seq_lens: Any, *a: Any, **kw: Any
        ) -> Any:
            self.prefill.append((offsets.shape[0] - 1, seq_lens.tolist()))
            return prefill(q, k_cache, v_cache, ids, offsets, starts, seq_lens, *a, **kw)

        monkeypatch.setattr(triton_attention, "paged_decode_attention", spied_decode)
        monkeypatch.setattr(triton_attention, "paged_prefill_attention", spied_prefill)


@pytest.mark.parametrize("layout", list(STEPS))
def test_decode_rows_of_a_mixed_step_go_to_the_decode_kernel(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = _Spy(monkeypatch)
    pairs = STEPS[layout]
    step = Step(pairs)
    step.run(TritonPagedAttention(HEADS, KV_HEADS, HEAD_DIM, SCALE), 0, 0.0)
    decodes = [c + 1 for c, n in pairs if n == 1]
    prompts = [c + n for c, n in pairs if n > 1]
    assert spy.decode == [(len(decodes), decodes)]
    assert spy.prefill == [(len(prompts), prompts)]  # the chunks only, not a row per decode


def test_steps_of_one_kind_launch_one_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = _Spy(monkeypatch)
    backend = TritonPagedAttention(HEADS, KV_HEADS, HEAD_DIM, SCALE)
    decodes, prompts = Step([(20, 1), (5, 1)]), Step([(0, 9), (19, 20)])
    decodes.run(backend, 0, 0.0)
    prompts.run(backend, 0, 0.0)
    assert spy.decode == [(2, [21, 6])] and spy.prefill == [(2, [9, 39])]
    assert decodes.meta(backend).decode_only and prompts.meta(backend).decodes is None


def test_mixed_metadata_splits_the_rows_on_the_host() -> None:
    meta = Step(INTERLEAVED).meta(TritonPagedAttention(HEADS, KV_HEADS, HEAD_DIM, SCALE))
    assert not meta.decode_only and meta.decodes is not None
    # Spans into the step's q: rows 1..20, 22..30 and 32..48 (a decode between each).
    assert meta.query_start_loc.tolist() == [[1, 22, 32], [21, 31, 49]]
    assert meta.decodes.rows is not None and meta.decodes.rows.tolist() == [0, 21, 31]
    assert meta.decodes.seq_lens.tolist() == [21, 41, 4]
    # Each kernel's rows cut to the blocks their own sequences read (the spare one dropped):
    # decodes of 21, 41 and 4 tokens, chunks of 39, 9 and 67; the longest bounds each kernel.
    assert meta.decodes.block_offsets.tolist() == [0, 2, 5, 6] and meta.decodes.max_blocks == 3
    assert meta.block_offsets.tolist() == [0, 3, 4, 9] and meta.max_blocks == 5
    consecutive = Step(CONSECUTIVE).meta(TritonPagedAttention(HEADS, KV_HEADS, HEAD_DIM, SCALE))
    assert consecutive.decodes is not None
    assert consecutive.decodes.rows is None and consecutive.decodes.first == 0  # q[0:3], no gather


def test_prefill_kernel_over_spans_writes_only_their_rows() -> None:
    # Three sequences whose rows sit apart in q: rows between spans belong to nobody here.
    pairs = [(19, 20), (0, 9), (50, 17)]
    lens = [c + n for c, n in pairs]
    k_cache, v_cache, block_tables = paged_cache(lens, KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.float32)
    tables = ragged(block_tables)
    spans = torch.tensor([[3, 24, 40], [23, 33, 57]], dtype=torch.int32, device=DEVICE)
    q = torch.randn(60, HEADS, HEAD_DIM, device=DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, 7.0)
    got = paged_prefill_attention(q, k_cache, v_cache, *tables, spans, seq_lens, SCALE, out=out, window=13)
    want = paged_prefill_attention_reference(q, k_cache, v_cache, *tables, spans, seq_lens, SCALE, 13)
    covered = torch.zeros(60, dtype=torch.bool)
    for a, b in spans.t().tolist():
        covered[a:b] = True
    assert_close(got[covered], want[covered], torch.float32)
    assert (got[~covered] == 7.0).all()
    # The same rows back to back give the same result as the spans did.
    rows = torch.cat([torch.arange(a, b) for a, b in spans.t().tolist()]).to(DEVICE)
    starts = torch.tensor([0, 20, 29, 46], dtype=torch.int32, device=DEVICE)
    packed = paged_prefill_attention(q[rows], k_cache, v_cache, *tables, starts, seq_lens, SCALE, window=13)
    torch.testing.assert_close(packed, got[rows.cpu()], atol=1e-5, rtol=1e-5)


def test_spans_of_the_wrong_shape_are_refused() -> None:
    k_cache, v_cache, block_tables = paged_cache([9, 20], KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.float32)
    q = torch.randn(29, HEADS, HEAD_DIM, device=DEVICE)
    seq_lens = torch.tensor([9, 20], dtype=torch.int32, device=DEVICE)
    spans = torch.zeros(2, 3, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"^query_start_loc: expected shape \(2, 2\)"):
        paged_prefill_attention(q, k_cache, v_cache, *ragged(block_tables), spans, seq_lens, SCALE)
