"""Grammar-constrained decoding: logits of the tokens a grammar forbids set to -inf, in place.

The masks come in xgrammar's packed layout: int32 [rows, ceil(vocab / 32)], bit j of word w
(least significant first) allows token 32 * w + j; words past the vocabulary's end are ignored.

One program per (row, tile of BLOCK tokens): it loads the tile's BLOCK / 32 words, expands them
to a [words, 32] grid of bits and writes -inf only where a bit is 0, so allowed logits are
neither read nor written and stay bit-identical.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import FLOAT_DTYPES, check_tensor, fail

BLOCK = 4096  # tokens per program: 128 words; a 128k vocabulary is 32 programs per row
BITS = 32  # tokens per mask word


@triton.jit
def _token_bitmask_kernel(logits_ptr, masks_ptr, stride_logits, stride_masks, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row * stride passes 2^31 at ~16k rows of a 128k vocabulary
    words = tl.program_id(1) * (BLOCK // 32) + tl.arange(0, BLOCK // 32)  # [W]
    bits = tl.arange(0, 32)  # [32]
    tokens = words[:, None] * 32 + bits[None, :]  # [W, 32]
    # A word holding no token of the vocabulary is not read: the masks may end there.
    packed = tl.load(masks_ptr + row * stride_masks + words, mask=words * 32 < vocab, other=-1)  # [W]
    forbidden = ((packed[:, None] >> bits[None, :]) & 1) == 0  # [W, 32]
    neg_inf = tl.full([BLOCK // 32, 32], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_logits + tokens, neg_inf, mask=forbidden & (tokens < vocab))


def check_token_bitmask(logits: torch.Tensor, masks: torch.Tensor, contiguous_last: bool = True) -> None:
    """logits [rows, vocab] of a float dtype; masks int32 [rows, >= ceil(vocab / 32)] on its device."""
    check_tensor("logits", logits, 2, FLOAT_DTYPES, contiguous_last=contiguous_last)
    rows, vocab = logits.shape
    check_tensor("masks", masks, 2, (torch.int32,), device=logits.device, contiguous_last=contiguous_last)
    words = triton.cdiv(vocab, BITS)
    if masks.shape[0] != rows or masks.shape[1] < words:
        fail(
            "masks",
            f"expected shape ({rows}, {words}) (one int32 word per 32 tokens of a {vocab}-token vocabulary,"
            f" more words allowed), got {tuple(masks.shape)}",
        )


def apply_token_bitmask_(logits: torch.Tensor, masks: torch.Tensor) -> None:
    """In place: logits [rows, vocab] (float32, float16 or bfloat16, last dim contiguous) get -inf wherever
    bit (t % 32) of masks[r, t // 32] is 0; masks int32 [rows, ceil(vocab / 32)] (xgrammar's packed layout:
    bit j of word w, least significant first, allows token 32*w + j). Words past the vocabulary's end are ignored."""
    check_token_bitmask(logits, masks)
    rows, vocab = logits.shape
    if rows and vocab:
        _token_bitmask_kernel[(rows, triton.cdiv(vocab, BLOCK))](
            logits, masks, logits.stride(0), masks.stride(0), vocab, BLOCK=BLOCK
        )


def apply_token_bitmask_reference(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """The torch version (returns a new tensor), used on the CPU and by tests."""
    check_token_bitmask(logits, masks, contiguous_last=False)
    rows, vocab = logits.shape
    shifts = torch.arange(BITS, dtype=torch.int32, device=masks.device)
    allowed = (masks[:, :, None] >> shifts) & 1  # [rows, words, 32]
    allowed = allowed.reshape(rows, masks.shape[1] * BITS)[:, :vocab]  # [rows, vocab]
    return logits.masked_fill(allowed == 0, float("-inf"))
