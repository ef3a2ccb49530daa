"""The wire form of a step's token masks: dense words for wide rows, allowed ids for narrow ones.

A mask row is ceil(vocab / 32) int32 words (6 KiB at a 49k vocabulary) however few tokens it
allows, and inside a JSON structure a grammar allows a handful: 256 such rows made 1.5 MiB of
every plan, which protobuf copies twice on each side. So a row that allows at most
`SPARSE_MAX_IDS` tokens travels as their ids instead, and the worker rebuilds the words.

    masks [k, words] --split--> sparse [k] (uint8), dense [k_dense, words],
                                offsets [k_sparse + 1], ids  --join--> masks
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

# A sparse row costs 4 bytes a token against 4 bytes a word for a dense one: below 1/8 of the
# words it is smaller, and its ids cost little to find and to set.
SPARSE_MAX_IDS = 192

_BITS = np.arange(32, dtype=np.uint32)


class SplitMasks(NamedTuple):
    sparse: np.ndarray  # uint8 [k]: 1 where the row travels as ids
    dense: np.ndarray  # int32 [k_dense, words]: the other rows, in order
    offsets: np.ndarray  # int32 [k_sparse + 1]: sparse row i allows ids[offsets[i]:offsets[i+1]]
    ids: np.ndarray  # int32: ascending within each row


def split(masks: np.ndarray, max_ids: int = SPARSE_MAX_IDS) -> SplitMasks:
    """int32 [k, words] masks as their wire parts (no Python loop over rows or tokens)."""
    words = masks.view(np.uint32)
    narrow = np.bitwise_count(words).sum(axis=1, dtype=np.int32) <= max_ids
    narrow_words = words if narrow.all() else words[narrow]
    # flatnonzero of a bool array is several times faster than np.nonzero of the words.
    flat = np.flatnonzero(narrow_words != 0)
    rows, cols = np.divmod(flat, max(words.shape[1], 1))
    set_bits = ((narrow_words.ravel()[flat][:, None] >> _BITS) & 1).astype(bool)  # [nonzero words, 32]
    word_of, bit = np.divmod(np.flatnonzero(set_bits), 32)
    ids = (cols[word_of] * 32 + bit).astype(np.int32)
    counts = np.bincount(rows[word_of], minlength=int(narrow.sum()))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return SplitMasks(narrow.astype(np.uint8), masks[~narrow], offsets, ids)


def join(parts: SplitMasks, words: int) -> np.ndarray:
    """The int32 [k, words] masks back from their wire parts."""
    sparse = parts.sparse.astype(bool)
    masks = np.zeros((sparse.size, words), np.uint32)
    masks[~sparse] = parts.dense.view(np.uint32)
    if parts.ids.size:
        row = np.flatnonzero(sparse)[np.repeat(np.arange(parts.offsets.size - 1), np.diff(parts.offsets))]
        np.bitwise_or.at(masks, (row, parts.ids >> 5), np.left_shift(np.uint32(1), (parts.ids & 31).astype(np.uint32)))
    return masks.view(np.int32)


def check(parts: SplitMasks, words: int) -> None:
    """Shape checks a worker runs before joining (a bad plan is a ValueError naming the field)."""
    sparse = parts.sparse
    k_sparse = int(sparse.sum())
    if parts.dense.shape != (sparse.size - k_sparse, words):
        raise ValueError(f"sampling.token_masks: {parts.dense.shape[0]} dense rows, want {sparse.size - k_sparse}")
    offsets = parts.offsets
    if (
        offsets.shape != (k_sparse + 1,)
        or offsets[0] != 0
        or offsets[-1] != parts.ids.size
        or (np.diff(offsets) < 0).any()
    ):
        raise ValueError("sampling.mask_id_offsets must be [sparse rows + 1] rising from 0 to the ids' length")
    if parts.ids.size and (int(parts.ids.min()) < 0 or int(parts.ids.max()) >= words * 32):
        raise ValueError("sampling.mask_token_ids must lie in the masks' words")
