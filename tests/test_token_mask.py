"""The token bitmask kernel against its torch reference, and the wrapper's refusals.

Without CUDA the kernel runs in Triton's interpreter (conftest sets TRITON_INTERPRET). Allowed
logits must come back bit-identical (the kernel never writes them) and forbidden ones -inf.
"""

from __future__ import annotations

import pytest
import torch

from kernels.token_mask import BLOCK, apply_token_bitmask_, apply_token_bitmask_reference
from tests.conftest import KERNEL_DEVICE

DEVICE = torch.device(KERNEL_DEVICE)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def random_masks(rows: int, words: int, seed: int) -> torch.Tensor:
    """Random int32 words (bit 31 set in about half: negative values), with whole words all zero
    and all one in every row, and the last word all zero in even rows: a kernel writing past the
    vocabulary's end then forbids the next row's first tokens."""
    g = torch.Generator().manual_seed(seed)
    masks = torch.randint(-(2**31), 2**31, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    masks[:, 0::5] = 0
    masks[:, 1::5] = -1
    masks[0::2, -1] = 0
    return masks


def allowed_by_bits(masks: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] bool, bit by bit in Python ints: an oracle for the reference."""
    words = masks.tolist()
    return torch.tensor([[(row[t // 32] >> (t % 32)) & 1 == 1 for t in range(vocab)] for row in words])


def check_against_reference(logits: torch.Tensor, masks: torch.Tensor) -> None:
    expected = apply_token_bitmask_reference(logits, masks)
    out = logits.clone()
    apply_token_bitmask_(out, masks)
    allowed = expected != float("-inf")
    # Bit-identical: compare the raw bits, not values (-0.0, NaN would pass or fail wrongly).
    int_dtype = {4: torch.int32, 2: torch.int16}[out.element_size()]
    assert torch.equal(out[allowed].view(int_dtype), logits[allowed].view(int_dtype))
    assert bool((out[~allowed] == float("-inf")).all())
    assert torch.equal(out == float("-inf"), ~allowed)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("vocab", [1000, 49152, 49155])
def test_kernel_matches_reference(dtype: torch.dtype, rows: int, vocab: int) -> None:
    words = -(-vocab // 32)
    g = torch.Generator().manual_seed(vocab + rows)
    logits = (torch.randn(rows, vocab, generator=g) * 8).to(dtype).to(DEVICE)
    masks = random_masks(rows, words, seed=vocab * 7 + rows).to(DEVICE)
    check_against_reference(logits, masks)


def test_reference_follows_the_packed_layout() -> None:
    """Bit j of word w, least significant first, allows token 32 * w + j."""
    vocab = 100
    masks = random_masks(3, 4, seed=1)
    masks[0, 0] = 0b101  # tokens 0 and 2 only, in the first word
    logits = torch.randn(3, vocab)
    out = apply_token_bitmask_reference(logits, masks)
    allowed = allowed_by_bits(masks, vocab)
    assert torch.equal(out != float("-inf"), allowed)
    assert torch.equal(out[allowed], logits[allowed])
    assert (out[0, :32] != float("-inf")).nonzero().flatten().tolist() == [0, 2]


def test_extra_trailing_words_are_ignored() -> None:
    """Masks wider than ceil(vocab / 32): the words past the vocabulary are never read."""
    rows, vocab = 3, 1000  # 32 words (the last one holds 8 tokens), given 40
    logits = torch.randn(rows, vocab).to(DEVICE)
    masks = random_masks(rows, 40, seed=2)
    masks[:, 32:] = 0  # would forbid everything if read
    masks = masks.to(DEVICE)
    check_against_reference(logits, masks)
    assert torch.equal(
        apply_token_bitmask_reference(logits, masks), apply_token_bitmask_reference(logits, masks[:, :32])
    )


def test_strided_rows() -> None:
    """Rows of a wider buffer (padded vocabulary) and masks sliced out of a wider word buffer."""
    rows, vocab = 2, BLOCK + 40
    big = torch.randn(rows, vocab + 24).to(DEVICE)
    logits = big[:, :vocab]
    masks = random_masks(rows, 200, seed=3).to(DEVICE)[:, 3 : 3 + -(-vocab // 32)]
    expected = apply_token_bitmask_reference(logits, masks)
    tail = big[:, vocab:].clone()
    apply_token_bitmask_(logits, masks)
    assert torch.equal(logits, expected)
    assert torch.equal(big[:, vocab:], tail)  # the padding columns past the vocabulary are untouched


def test_empty_batch_is_a_no_op() -> None:
    logits = torch.empty(0, 1000).to(DEVICE)
    masks = torch.empty(0, 32, dtype=torch.int32).to(DEVICE)
    apply_token_bitmask_(logits, masks)
    assert apply_token_bitmask_reference(logits, masks).shape == (0, 1000)


@pytest.mark.parametrize(
    ("logits", "masks", "message"),
    [
        (torch.zeros(1000), torch.zeros(1, 32, dtype=torch.int32), "logits: expected 2 dimensions"),
        (torch.zeros(2, 1000), torch.zeros(2, 32, 1, dtype=torch.int32), "masks: expected 2 dimensions"),
        (torch.zeros(2, 1000, dtype=torch.int32), torch.zeros(2, 32, dtype=torch.int32), "logits: dtype"),
        (torch.zeros(2, 1000), torch.zeros(2, 32, dtype=torch.int64), "masks: dtype torch.int64"),
        (torch.zeros(2, 1000), torch.zeros(2, 32, dtype=torch.uint8), "masks: dtype torch.uint8"),
        (torch.zeros(2, 1000), torch.zeros(3, 32, dtype=torch.int32), r"masks: expected shape \(2, 32\)"),
        (torch.zeros(2, 1000), torch.zeros(2, 31, dtype=torch.int32), r"masks: expected shape \(2, 32\)"),
        (torch.zeros(1000, 2).t(), torch.zeros(2, 32, dtype=torch.int32), "logits: the last dimension"),
        (torch.zeros(2, 1000), torch.zeros(32, 2, dtype=torch.int32).t(), "masks: the last dimension"),
        (torch.zeros(2, 1000), torch.zeros(2, 32, dtype=torch.int32, device="meta"), "masks: on meta"),
    ],
    ids=[
        "logits-1d",
        "masks-3d",
        "logits-int",
        "masks-int64",
        "masks-uint8",
        "masks-rows",
        "masks-too-few-words",
        "logits-strided",
        "masks-strided",
        "masks-device",
    ],
)
def test_wrapper_refuses(logits: torch.Tensor, masks: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        apply_token_bitmask_(logits, masks)
