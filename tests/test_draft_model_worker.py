"""The worker's draft model, one step at a time: the proposals it returns after a step are the
greedy continuation of the token the step sampled (the model drafting for itself, on the
reference attention and on our C++ kernels), the next step verifies them all, and plans the
worker cannot propose for are refused before anything runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from common.config import CacheConfig, WorkerConfig
from tests.conftest import make_tiny_model, transformers_greedy
from tests.plans import Feed, make_plan
from worker_svc.step.draft_model import DraftModel
from worker_svc.step.runner import ModelRunner, PlanError

BLOCK = 8
PROMPT = [5, 17, 42, 99, 3, 150, 7, 61, 23, 88]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """Heads of 64 (the C++ kernels' smallest), a vocabulary of 200, positions to 64."""
    shape = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=64)
    return make_tiny_model(tmp_path_factory.mktemp("draft-target") / "m", smollm2_dir, vocab_size=200, **shape)


def runner(model_dir: Path, backend: str, draft: Path | None) -> ModelRunner:
    return ModelRunner(
        WorkerConfig(
            model=str(model_dir),
            dtype="float32",
            device="cpu",
            attention_backend=backend,
            cache=CacheConfig(block_size=BLOCK, num_gpu_blocks=16),
            speculative_model=str(draft) if draft else "",
        )
    )


def greedy(model_dir: Path, count: int) -> list[int]:
    return transformers_greedy(model_dir, [PROMPT], count)[0]


def asking(plan, lens: list[int]):  # type: ignore[no-untyped-def]
    return dataclasses.replace(plan, propose_lens=np.array(lens, np.int32))


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_proposals_continue_the_sampled_token_and_the_next_step_keeps_them(model_dir: Path, backend: str) -> None:
    want = greedy(model_dir, 8)
    r = runner(model_dir, backend, draft=model_dir)
    assert r.info("m").draft_model == model_dir.name
    # The prompt: 10 tokens in blocks 0-1; proposing 3 writes up to position 12 (block 1).
    first = r.execute(asking(make_plan(0, [Feed(1, PROMPT, 0, [0, 1])]), [3]))
    assert first.sampled_token_ids.tolist() == want[:1]
    assert first.draft_proposals.tolist() == want[1:4]
    # Verify [last token, 3 proposals]: all kept, the 5th token sampled, 3 more proposed
    # from it (positions 14-16: block 2).
    feed = [want[0], *want[1:4]]
    plan = dataclasses.replace(
        make_plan(1, [Feed(1, feed, len(PROMPT), [0, 1, 2])]), draft_lens=np.array([3], np.int32)
    )
    second = r.execute(asking(plan, [3]))
    assert second.num_accepted.tolist() == [3] and second.sampled_token_ids.tolist() == [want[4]]
    assert second.draft_proposals.tolist() == want[5:8]


def test_plans_the_worker_cannot_propose_for_are_refused(model_dir: Path) -> None:
    plan = asking(make_plan(0, [Feed(1, PROMPT, 0, [0, 1])]), [3])
    with pytest.raises(PlanError, match="no draft model"):
        runner(model_dir, "torch", draft=None).execute(plan)
    r = runner(model_dir, "torch", draft=model_dir)
    with pytest.raises(PlanError, match="too short for the proposals"):
        r.execute(asking(make_plan(0, [Feed(1, PROMPT, 0, [0, 1])]), [7]))  # position 16: a third block
    with pytest.raises(PlanError, match="past the model's context"):
        r.execute(asking(make_plan(0, [Feed(1, PROMPT, 0, [0, 1])]), [60]))


def test_a_draft_model_of_another_vocabulary_is_refused(smollm2_dir: Path, tmp_path: Path) -> None:
    other = make_tiny_model(tmp_path / "other", smollm2_dir, vocab_size=300, head_dim=64)
    with pytest.raises(ValueError, match="vocabulary of 300 tokens"):
        DraftModel(str(other), torch.float32, torch.device("cpu"), "torch", vocab_size=200, max_model_len=64)
