"""The grouped GEMMs' tile height follows the step's rows per expert.

Decode batches keep 16-row tiles (an expert holds a few rows); long prefill steps take 64- or
128-row tiles, which read each expert's weights fewer times. Each height is a compile
variant, so the set is small and the warm-up can find a step for each.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kernels import fused_moe as moe
from kernels.fused_moe import fused_moe, fused_moe_reference, moe_block_m, moe_block_m_tokens, moe_block_ms
from tests.test_kernels import DEVICE, assert_close


def test_the_variants_are_few_and_ascending() -> None:
    assert moe_block_ms() == (16, 64, 128)


@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "block_m"),
    [
        (1, 2, 8, 16),
        (256, 2, 8, 16),  # Mixtral decoding 256 sequences: 64 rows per expert
        (511, 2, 8, 16),
        (512, 2, 8, 64),  # 128 rows per expert fill two 64-row tiles
        (1023, 2, 8, 64),
        (1024, 2, 8, 128),
        (16384, 2, 8, 128),
        (2047, 8, 128, 16),  # Qwen3-MoE: 128 experts, 8 each
        (2048, 8, 128, 64),
        (4096, 8, 128, 128),
    ],
)
def test_block_m_by_token_count(tokens: int, top_k: int, experts: int, block_m: int) -> None:
    assert moe_block_m(tokens, top_k, experts) == block_m


@pytest.mark.parametrize(("top_k", "experts"), [(2, 8), (8, 128), (1, 4), (6, 64)])
def test_block_m_never_shrinks_as_steps_grow(top_k: int, experts: int) -> None:
    picks = [moe_block_m(t, top_k, experts) for t in range(1, 5000)]
    assert picks == sorted(picks) and set(picks) <= set(moe_block_ms())


@pytest.mark.parametrize(("top_k", "experts"), [(2, 8), (8, 128), (1, 4), (6, 64)])
def test_warm_up_tokens_are_the_fewest_that_pick_each_variant(top_k: int, experts: int) -> None:
    limit = 8192
    found = moe_block_m_tokens(top_k, experts, limit)
    reached = {moe_block_m(t, top_k, experts) for t in range(1, limit + 1)}
    assert set(found) == reached  # every variant a step up to the limit can pick, no other
    for block_m, tokens in found.items():
        assert moe_block_m(tokens, top_k, experts) == block_m
        assert tokens == 1 or moe_block_m(tokens - 1, top_k, experts) < block_m


def test_warm_up_tokens_within_a_small_step_limit() -> None:
    assert moe_block_m_tokens(2, 8, 600) == {16: 1, 64: 512}
    assert moe_block_m_tokens(2, 8, 1024) == {16: 1, 64: 512, 128: 1024}


# A step for each tile height: 4 experts, 2 choices each (mean rows per expert: tokens / 2,
# at least twice the tile).
STEPS = [(16, 37), (64, 300), (128, 600)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("block_m", "tokens"), STEPS)
def test_fused_moe_at_each_block_m_equals_the_reference(
    dtype: torch.dtype, block_m: int, tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    experts, top_k, hidden, inter = 4, 2, 64, 80  # an intermediate width off the tiles
    used: list[int] = []
    align = moe.align_by_expert

    def recorded(ids: torch.Tensor, num_experts: int, m: int = moe.BLOCK_M) -> Any:
        used.append(m)
        return align(ids, num_experts, m)

    monkeypatch.setattr(moe, "align_by_expert", recorded)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).to(dtype).to(DEVICE)
    w13 = (0.1 * torch.randn(experts, 2 * inter, hidden, generator=g)).to(dtype).to(DEVICE)
    w2 = (0.1 * torch.randn(experts, hidden, inter, generator=g)).to(dtype).to(DEVICE)
    # Skewed routing: expert 0 takes most rows (several tiles), expert 3 a few.
    logits = torch.randn(tokens, experts, generator=g) + torch.tensor([2.0, 0.5, 0.0, -1.5])
    weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
    weights, ids = weights.to(DEVICE), ids.to(DEVICE)
    got = fused_moe(x, w13, w2, weights, ids)
    assert used == [block_m]
    assert_close(got, fused_moe_reference(x, w13, w2, weights, ids), dtype)
