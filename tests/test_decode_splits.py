"""The decode kernel splits each sequence's visible keys, not the block table's capacity.

A CUDA graph's launch takes max_blocks as wide as the longest context the model allows; when
the splits cut that capacity, a short sequence in it fell wholly into the first split and the device
ran one program per (sequence, KV head). What the kernel did is read back from the split-K
workspace: a split that attended to at least one key leaves a positive softmax sum there.
"""

from __future__ import annotations

import pytest
import torch

from kernels import paged_attention
from kernels.paged_attention import (
    decode_launch,
    default_num_splits,
    paged_decode_attention,
    paged_decode_attention_reference,
)
from kernels.workspace import workspace
from tests.test_kernels import DEVICE, assert_close, paged_cache, ragged

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 16, 16
WIDE = 131072 // BLOCK  # a 128k-context model's graph width


@pytest.fixture(autouse=True)
def h200(monkeypatch: pytest.MonkeyPatch) -> None:
    """The split heuristic sees an H200's 132 SMs, as it would on the device."""
    monkeypatch.setattr(paged_attention, "_parallel_units", lambda device: 2 * 132)


def filled_splits(lens: list[int], width: int, window: int = 0) -> list[int]:
    """Run the kernel on sequences of `lens` launched with max_blocks = `width`: how many splits
    of each sequence attended to a key (the same for all its heads), after checking the output."""
    k_cache, v_cache, tables = paged_cache(lens, KV_HEADS, HEAD_DIM, BLOCK, torch.float32)
    ids, offsets = ragged(tables)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), HEADS, HEAD_DIM, device=DEVICE)
    got = paged_decode_attention(q, k_cache, v_cache, ids, offsets, seq_lens, 0.25, width, window=window)
    want = paged_decode_attention_reference(q, k_cache, v_cache, ids, offsets, seq_lens, 0.25, window)
    assert_close(got, want, q.dtype)
    tile = decode_launch(HEAD_DIM, q.dtype, HEADS // KV_HEADS, q.is_cuda).keys
    splits = default_num_splits(len(lens), KV_HEADS, width, BLOCK, tile, q.device, window=window)
    parts = len(lens) * HEADS * splits
    _, _, sums = workspace(q.device, parts * HEAD_DIM, parts, parts)  # the views the launch wrote
    filled = (sums.view(len(lens), HEADS, splits) > 0).sum(-1)  # [seqs, heads]
    assert (filled == filled[:, :1]).all()
    return filled[:, 0].tolist()


def test_a_short_sequence_gets_as_many_splits_in_a_graphs_wide_table() -> None:
    lens = [300, 40]  # 5 tiles and 1; two sequences of 8 KV heads ask for 17 splits
    narrow = -(-max(lens) // BLOCK)
    assert filled_splits(lens, narrow) == [5, 1]
    assert filled_splits(lens, WIDE) == [5, 1]  # it was [1, 1]: 8 programs did the work of 40


def test_a_window_shares_its_splits_out_over_the_visible_keys() -> None:
    # The last 100 keys of 300 are two tiles: both split, none spent before the window.
    assert filled_splits([300, 40], WIDE, window=100) == [2, 1]


def test_forced_splits_beyond_a_sequence_stay_empty() -> None:
    lens = [1, 70, 200]
    k_cache, v_cache, tables = paged_cache(lens, KV_HEADS, HEAD_DIM, BLOCK, torch.float32, extra_blocks=3)
    ids, offsets = ragged(tables)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(3, HEADS, HEAD_DIM, device=DEVICE)
    want = paged_decode_attention_reference(q, k_cache, v_cache, ids, offsets, seq_lens, 0.25)
    got = paged_decode_attention(q, k_cache, v_cache, ids, offsets, seq_lens, 0.25, tables.max_len, num_splits=5)
    assert_close(got, want, q.dtype)
    parts = 3 * HEADS * 5
    _, _, sums = workspace(q.device, parts * HEAD_DIM, parts, parts)
    # Whole tiles of 64: 1 token fills one split, 70 two, 200 four of the five.
    assert (sums.view(3, HEADS, 5) > 0).sum(-1)[:, 0].tolist() == [1, 2, 4]


def test_the_split_count_is_capped_by_the_visible_range_the_table_allows() -> None:
    cpu = torch.device("cpu")
    assert default_num_splits(1, 8, WIDE, BLOCK, 64, cpu) == 33  # 264 programs
    assert default_num_splits(1, 8, 5, BLOCK, 64, cpu) == 2  # 80 tokens: two tiles
    assert default_num_splits(1, 8, WIDE, BLOCK, 64, cpu, window=100) == 2
    assert default_num_splits(1, 1, WIDE, BLOCK, 64, cpu) == paged_attention.MAX_SPLITS
    assert default_num_splits(256, 8, WIDE, BLOCK, 64, cpu) == 1
