"""Logit processing and filters on the worker, against references of the distribution.

Repetition penalty, min-p, top-k and top-p are compared with transformers' own logits
processors; presence and frequency penalties with OpenAI's formula written out; the sampled
frequencies with the reference distribution.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from common.plan import SamplingBatch
from worker_svc.sampling.logits_processor import process_logits
from worker_svc.sampling.sampler import sample

VOCAB = 40


def batch(n: int, **arrays: np.ndarray) -> SamplingBatch:
    base = dict(
        temperature=np.ones(n, np.float32),
        top_p=np.ones(n, np.float32),
        top_k=np.zeros(n, np.int32),
        seed=np.arange(n, dtype=np.int64),
        output_position=np.zeros(n, np.int32),
    )
    base.update(arrays)
    return SamplingBatch(**base)  # type: ignore[arg-type]


def ragged(lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.concatenate([[0], np.cumsum([len(x) for x in lists])]).astype(np.int32)
    return offsets, np.array([t for x in lists for t in x], np.int32)


def test_repetition_penalty_matches_transformers() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 3
    histories = [[1, 5, 5, 9], [], [0, 39, 2]]
    offsets, ids = ragged(histories)
    b = batch(
        3,
        repetition_penalty=np.array([1.3, 1.0, 0.7], np.float32),
        presence_penalty=np.zeros(3, np.float32),
        frequency_penalty=np.zeros(3, np.float32),
        history_offsets=offsets,
        history_token_ids=ids,
        output_position=np.array([2, 0, 1], np.int32),
    )
    got = process_logits(logits, b, np.arange(3))
    for i, (hist, p) in enumerate(zip(histories, [1.3, 1.0, 0.7])):
        want = (
            RepetitionPenaltyLogitsProcessor(p)(torch.tensor([hist or [0]]), logits[i : i + 1].clone())
            if hist
            else logits[i : i + 1]
        )
        torch.testing.assert_close(got[i : i + 1], want)


def test_presence_and_frequency_penalties_count_output_tokens_only() -> None:
    logits = torch.zeros(1, VOCAB)
    # prompt [7, 7, 3] then output [3, 3, 8]
    offsets, ids = ragged([[7, 7, 3, 3, 3, 8]])
    b = batch(
        1,
        repetition_penalty=np.ones(1, np.float32),
        presence_penalty=np.full(1, 0.5, np.float32),
        frequency_penalty=np.full(1, 0.25, np.float32),
        history_offsets=offsets,
        history_token_ids=ids,
        output_position=np.full(1, 3, np.int32),
    )
    got = process_logits(logits, b, np.arange(1))[0]
    want = torch.zeros(VOCAB)
    want[3] = -(0.5 + 0.25 * 2)
    want[8] = -(0.5 + 0.25 * 1)
    torch.testing.assert_close(got, want)  # token 7 is prompt only: untouched


def test_logit_bias_adds_and_bans_only_its_rows() -> None:
    logits = torch.zeros(3, VOCAB)
    offsets, ids = ragged([[4, 4], [], [9]])
    b = batch(3, bias_offsets=offsets, bias_token_ids=ids, bias_values=np.array([1.5, 2.0, -np.inf], np.float32))
    got = process_logits(logits, b, np.array([0, 1, 2]))
    assert got[0, 4].item() == 3.5 and got[0].abs().sum().item() == 3.5
    assert got[1].abs().sum().item() == 0
    assert got[2, 9].item() == float("-inf")
    assert logits.abs().sum().item() == 0  # the raw logits (for logprobs) are left alone
    # Only the plan rows that sampled are given; their bias follows them.
    only_last = process_logits(logits[:1], b, np.array([2]))
    assert only_last[0, 9].item() == float("-inf")


def _frequencies(logits: torch.Tensor, n: int, **filters: float) -> torch.Tensor:
    b = dict(
        temperature=np.full(n, filters.get("temperature", 1.0), np.float32),
        top_p=np.full(n, filters.get("top_p", 1.0), np.float32),
        top_k=np.full(n, int(filters.get("top_k", 0)), np.int32),
        seed=np.arange(n, dtype=np.int64),
        position=np.zeros(n, np.int32),
        min_p=np.full(n, filters.get("min_p", 0.0), np.float32),
    )
    tokens = sample(logits.repeat(n, 1), **b)
    return torch.bincount(tokens, minlength=logits.shape[-1]).double() / n


def _reference(logits: torch.Tensor, temperature: float, warpers: list) -> torch.Tensor:  # type: ignore[type-arg]
    scores = logits / temperature
    for warper in warpers:
        scores = warper(torch.zeros(1, 1, dtype=torch.long), scores)
    return torch.softmax(scores[0].double(), -1)


def test_min_p_top_k_top_p_follow_the_reference_distribution() -> None:
    torch.manual_seed(3)
    logits = torch.randn(1, VOCAB) * 2.5
    n = 40_000
    cases = [
        ({"min_p": 0.1, "temperature": 0.8}, [MinPLogitsWarper(0.1)]),
        ({"top_k": 5, "temperature": 1.2}, [TopKLogitsWarper(5)]),
        ({"top_p": 0.7}, [TopPLogitsWarper(0.7)]),
    ]
    for filters, warpers in cases:
        got = _frequencies(logits, n, **filters)
        want = _reference(logits, filters.get("temperature", 1.0), warpers)
        assert set(got.nonzero().flatten().tolist()) <= set(want.nonzero().flatten().tolist()), filters
        assert (got - want).abs().max().item() < 0.012, filters


def test_min_p_and_top_k_together_follow_the_reference() -> None:
    torch.manual_seed(4)
    logits = torch.randn(1, VOCAB) * 2
    got = _frequencies(logits, 40_000, min_p=0.05, top_k=8)
    want = _reference(logits, 1.0, [MinPLogitsWarper(0.05), TopKLogitsWarper(8)])
    assert (got - want).abs().max().item() < 0.012
