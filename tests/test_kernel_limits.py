"""kernels/limits.py: the step size up to which the kernels' int32 indices cannot wrap."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernels.limits import INT32_MAX, _largest_tokens_with_tiles_within, max_tokens_per_step

SMOLLM2_135M = dict(hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536)
LLAMA3_8B = dict(hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336)


@pytest.mark.parametrize("tile_m", [1, 16, 64, 128])
@pytest.mark.parametrize("limit", [0, 1, 127, 128, 129, 1000, INT32_MAX])
def test_largest_tokens_is_exact(limit: int, tile_m: int) -> None:
    tokens = _largest_tokens_with_tiles_within(limit, tile_m)
    assert tokens + tokens // tile_m <= limit
    assert tokens + 1 + (tokens + 1) // tile_m > limit


@pytest.mark.parametrize("shape", [SMOLLM2_135M, LLAMA3_8B], ids=["smollm2-135m", "llama3-8b"])
def test_the_prefill_tile_index_binds(shape: dict[str, int]) -> None:
    """Every batch-sized offset is int64: only the int32 tile index (T + T // TILE_M) is left."""
    tokens = max_tokens_per_step(**shape)
    # 64: float32's prefill tiles, the smallest any dtype uses, make the most tiles.
    assert tokens == _largest_tokens_with_tiles_within(INT32_MAX, 64) == 2_114_445_438


def test_a_row_past_int32_leaves_no_safe_step() -> None:
    assert max_tokens_per_step(**{**LLAMA3_8B, "intermediate_size": 2**30}) == 0
    assert max_tokens_per_step(**{**LLAMA3_8B, "num_heads": 2**20}) == 0


def test_shapes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="^head_dim must be positive"):
        max_tokens_per_step(**{**SMOLLM2_135M, "head_dim": 0})


def test_the_limit_of_a_checkpoint_is_its_whole_shape() -> None:
    from transformers import LlamaConfig

    from worker_svc.step.loader import triton_token_limit

    config = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336)
    assert triton_token_limit(config) == max_tokens_per_step(**LLAMA3_8B)
    assert triton_token_limit(LlamaConfig(**{**config.to_dict(), "intermediate_size": 2**30})) == 0


def test_a_worker_refuses_a_token_budget_past_the_limit(tmp_path: Path) -> None:
    """At start, before the weights load: with --attention-backend triton a budget the kernels
    cannot index is an error naming the flag and the limit."""
    from transformers import LlamaConfig

    from common.config import WorkerConfig
    from worker_svc.step.runner import ModelRunner

    LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=2**30,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    ).save_pretrained(tmp_path)  # no weights: refused before they are read
    with pytest.raises(ValueError, match=r"^--max-num-batched-tokens 2048 is above 0, the most tokens one step"):
        ModelRunner(WorkerConfig(model=str(tmp_path), dtype="float32", device="cpu", attention_backend="triton"))
    budget = max_tokens_per_step(**SMOLLM2_135M) + 1
    LlamaConfig(
        vocab_size=64,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=1,
        num_attention_heads=9,
        num_key_value_heads=3,
    ).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"^--max-num-batched-tokens {budget} is above {budget - 1}"):
        ModelRunner(
            WorkerConfig(
                model=str(tmp_path),
                dtype="float32",
                device="cpu",
                attention_backend="triton",
                max_num_batched_tokens=budget,
            )
        )
