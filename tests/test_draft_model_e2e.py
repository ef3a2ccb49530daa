"""Speculative decoding with a draft model, end to end: the offline LLM's worker process runs
the model and a draft model beside it, and greedy float32 outputs are transformers' token for
token, whether the draft is the model itself (every proposal kept), a model of its first
layer (most rejected), or a tiny pool makes sequences swap out and back in (the draft
model's cache travels with the model's: a stale one would show as rejected proposals)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.draft_models import truncated
from llmserve import LLM, SamplingParams
from tests.conftest import transformers_greedy

NEW_TOKENS = 24
ENGINE = {"dtype": "float32", "device": "cpu", "max_num_seqs": 8}


def prompts() -> list[list[int]]:
    rng = torch.Generator().manual_seed(5)
    passage = torch.randint(3, 49152, (40,), generator=rng).tolist()
    return [passage + passage[:25], [17, 18, 19] * 12, torch.randint(3, 49152, (30,), generator=rng).tolist()]


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> list[list[int]]:
    return transformers_greedy(tiny_model_dir, prompts(), NEW_TOKENS)


def generate(llm: LLM, params: SamplingParams) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.mark.parametrize(
    ("layers", "pool", "mode"),
    [(2, 256, "auto"), (1, 256, "auto"), (2, 12, "swap"), (2, 12, "recompute")],
    ids=["itself", "first-layer", "swapping", "recomputing"],
)
def test_greedy_with_a_draft_model_equals_transformers(
    tiny_model_dir: Path, tmp_path: Path, reference: list[list[int]], layers: int, pool: int, mode: str
) -> None:
    draft = truncated(tiny_model_dir, tmp_path / f"draft-{layers}", layers)
    spec = {"method": "draft", "model": str(draft), "num_speculative_tokens": 3}
    with LLM(str(tiny_model_dir), speculative_config=spec, num_gpu_blocks=pool, preemption_mode=mode, **ENGINE) as llm:
        assert generate(llm, GREEDY) == reference
        scheduler = llm._engine.engine.replicas[0].scheduler
        assert scheduler is not None and scheduler.drafter is not None
        drafter, bm = scheduler.drafter, scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        if pool < 256:
            assert scheduler.queues.num_preemptions > 0
    assert drafter.drafted_total > 0
    if layers == 2:  # the model proposing for itself: every proposal is its own next token
        assert drafter.accepted_total == drafter.drafted_total
    else:
        assert drafter.accepted_total < drafter.drafted_total


def test_sampled_requests_with_a_draft_model_repeat_under_their_seed(tiny_model_dir: Path, tmp_path: Path) -> None:
    spec = {"method": "draft_model", "model": str(truncated(tiny_model_dir, tmp_path / "draft", 1))}
    params = SamplingParams(temperature=0.8, top_k=50, max_tokens=NEW_TOKENS, ignore_eos=True, seed=11)
    with LLM(str(tiny_model_dir), speculative_config=spec, num_gpu_blocks=256, **ENGINE) as llm:
        first, again = generate(llm, params), generate(llm, params)
    assert all(len(o) == NEW_TOKENS for o in first) and first == again
