"""Speculative decoding survives a lost worker group: two real SmolLM2 worker processes serve
n-gram drafting requests, one is killed (SIGKILL) while they stream, and every output, moved or not,
is still transformers' greedy output token for token (float32), with drafts kept on both runs.

A sequence carries its n-gram index and its drafting record with it (scheduler_svc/sched/
draft_state.py); the drafts in flight when the worker died were never verified, so they must be
dropped with the step, not counted as kept: either mistake shows up as a token that differs.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from common.pb.llmserve.v1 import generation_pb2 as pb
from common.speculative_config import SpeculativeConfig
from tests.conftest import Generation, Scheduler, collect, request, transformers_greedy
from tests.test_scale_out import Worker, mid_generation, recovered, worker_groups

NEW_TOKENS = 64
SPEC = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
SENTENCES = (
    "Return books within fourteen days.",
    "Keep your voice down in the reading room.",
    "Never eat near the rare manuscripts.",
    "Ask the desk before you copy a map.",
    "Leave umbrellas by the front door.",
    "Bring your card to borrow a laptop.",
)


def prompts(model_dir: Path) -> list[list[int]]:
    """A list of rules quoted three times and begun a fourth: SmolLM2 goes on quoting, and
    prompt lookup drafts what it writes. Each prompt rotates the rules, so none is another's."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    out = []
    for i in range(8):
        rules = " ".join(SENTENCES[(i + j) % len(SENTENCES)] for j in range(3 + i % 3))
        out.append(tokenizer(f"Rules: {rules} " * 3 + "Rules:")["input_ids"])
    return out


@pytest.fixture(scope="module")
def reference(smollm2_dir: Path) -> list[list[int]]:
    return transformers_greedy(smollm2_dir, prompts(smollm2_dir), NEW_TOKENS)


@pytest.fixture(params=["ngram", "draft"])
async def drafting_groups(
    request: pytest.FixtureRequest, smollm2_dir: Path, tmp_path: Path
) -> AsyncIterator[tuple[Scheduler, list[Worker]]]:
    """N-gram drafts, or a draft model's: SmolLM2 itself, so that it proposes what the model
    writes (a draft cache that the recovery left stale would show as rejected drafts, never
    as different tokens: `kept` tells)."""
    spec, flags = SPEC, ()
    if request.param == "draft":
        spec = SpeculativeConfig(method="draft", num_speculative_tokens=4)
        flags = ("--speculative-model", str(smollm2_dir))
    async with worker_groups(smollm2_dir, worker_flags=flags, speculative=spec) as groups:
        yield groups


def kept(runs: list[Generation]) -> int:
    return sum(g.final.stats.spec_accepted_tokens for g in runs)


def drafted(runs: list[Generation]) -> int:
    return sum(g.final.stats.spec_draft_tokens for g in runs)


@pytest.mark.slow
async def test_drafting_requests_moved_off_a_killed_worker_still_equal_transformers(
    smollm2_dir: Path, drafting_groups: tuple[Scheduler, list[Worker]], reference: list[list[int]]
) -> None:
    s, workers = drafting_groups
    reqs = [request(ids=p, max_tokens=NEW_TOKENS, ignore_eos=True) for p in prompts(smollm2_dir)]
    undisturbed = await asyncio.gather(*(collect(s.stub, r) for r in reqs))
    assert [g.token_ids for g in undisturbed] == reference
    assert kept(undisturbed) > 0, "no draft was kept: the test would not exercise verification"
    assert all(r.scheduler.next_step_id > 0 for r in s.engine.replicas)  # both groups served
    before = recovered(s, smollm2_dir.name)

    tasks = [asyncio.create_task(collect(s.stub, r)) for r in reqs]
    await mid_generation(s, workers[0])
    workers[0].proc.send_signal(signal.SIGKILL)
    disturbed = await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)

    assert [g.token_ids for g in disturbed] == reference
    assert all(g.final.finish_reason == pb.FINISH_REASON_LENGTH for g in disturbed)
    assert recovered(s, smollm2_dir.name) - before >= 1, "no request was moved"
    assert kept(disturbed) > 0
    if s.engine.config.speculative.method == "draft":  # the model drafting for itself
        assert kept(disturbed) >= 0.9 * drafted(disturbed)
    assert [r.name for r in s.engine.replicas] == [workers[1].address]
    await s.wait_idle()  # every block of the surviving group back in its pool
