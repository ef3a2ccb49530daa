"""Speculative decoding on the worker: prompt-lookup proposals, greedy verification, and
rejection sampling that keeps the output distribution exactly (a chi-square test)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.plan import SamplingBatch
from scheduler_svc.sched.ngram_index import NgramIndex
from worker_svc.sampling.draft_verifier import verify


def batch(n: int, temperature: float = 0.0, seeds: np.ndarray | None = None, top_k: int = 0) -> SamplingBatch:
    return SamplingBatch(
        temperature=np.full(n, temperature, np.float32),
        top_p=np.ones(n, np.float32),
        top_k=np.full(n, top_k, np.int32),
        seed=np.arange(n, dtype=np.int64) if seeds is None else seeds,
        output_position=np.zeros(n, np.int32),
    )


def test_prompt_lookup_proposes_what_followed_the_latest_longest_match() -> None:
    index = NgramIndex(min_n=1, max_n=3, window=1000)
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 6, 7]
    # the suffix [6, 7] last occurred before 2; [2, 6, 7] never did
    assert index.propose(tokens, 3) == [2, 6, 7]
    tokens += [8]  # [6, 7, 8] occurred at the start
    assert index.propose(tokens, 2) == [9, 1]
    assert index.propose(tokens + [42], 4) == []  # a token never seen before
    assert NgramIndex(2, 2, 1000).propose([1, 2, 3], 2) == []  # nothing repeats


def test_a_match_fewer_than_k_tokens_back_drafts_round_its_loop() -> None:
    """Text caught in a loop (SmolLM2's greedy output often is): the latest occurrence of the
    suffix is one period back, with fewer than k tokens after it; the draft repeats the period."""
    index = NgramIndex(min_n=2, max_n=3, window=1000)
    assert index.propose([5, 1, 2, 3, 1, 2, 3, 1, 2], 6) == [3, 1, 2, 3, 1, 2]
    assert NgramIndex(2, 3, 1000).propose([7, 2, 2, 2], 4) == [2, 2, 2, 2]
    assert NgramIndex(2, 3, 1000).propose([7, 8, 9, 7, 8], 2) == [9, 7]  # enough tokens after it


def test_prompt_lookup_indexes_a_long_prompt_only_near_its_end() -> None:
    index = NgramIndex(min_n=2, max_n=2, window=10)
    tokens = [1, 2, 3] + list(range(100, 200)) + [1, 2]
    assert index.propose(tokens, 1) == []  # [1, 2] lies beyond the window
    assert index.propose(tokens + [3, 1, 2], 1) == [3]  # seen again since


def test_greedy_rows_keep_drafts_while_they_are_the_argmax() -> None:
    vocab = 10
    want = [[3, 4, 5, 6], [7, 8]]  # each row's argmax at its positions
    logits = torch.full((6, vocab), -5.0)
    for i, t in enumerate([3, 4, 5, 6, 7, 8]):
        logits[i, t] = 5.0
    drafts = np.array([3, 4, 9, 7], np.int32)  # row 0: keeps 3, 4, rejects 9; row 1: keeps 7
    v = verify(logits, drafts, np.array([3, 1], np.int32), batch(2), np.arange(2))
    assert v.accepted.tolist() == [2, 1]
    assert v.tokens.tolist() == [want[0][2], want[1][1]]  # the argmax where the first rejection was
    lse = torch.logsumexp(logits, -1)
    assert np.allclose(v.draft_logprobs[:2], (logits[[0, 1], [3, 4]] - lse[[0, 1]]).numpy())
    assert np.allclose(v.logprobs[0], float(logits[2, 5] - lse[2]))


def test_a_masked_position_keeps_the_draft_its_grammar_would_choose() -> None:
    """A structured output's row: each position's mask applies before the argmax, as in its
    decode. The raw argmax (token 9) is refused at every position; the draft [3, 4] is what the
    masks leave highest, so both are kept, and the token after them obeys the third mask.
    Log-probabilities stay those of the raw logits."""
    from tests.test_structured_output import _packed

    vocab = 10
    logits = torch.full((3, vocab), -5.0)
    logits[:, 9] = 9.0
    for i, t in enumerate([3, 4, 6]):
        logits[i, t] = 5.0
    logits[2, 5] = 7.0  # above 6, but the third mask allows only 6
    masks = {"mask_rows": np.array([0], np.int32), "token_masks": _packed([[3], [4], [6]], vocab)}
    s = SamplingBatch(**{**batch(1).__dict__, **masks})  # the row's 3 masks, from mask row 0 on
    drafts = np.array([3, 4], np.int32)
    unmasked = verify(logits, drafts, np.array([2], np.int32), batch(1), np.arange(1))
    assert unmasked.accepted.tolist() == [0] and unmasked.tokens.tolist() == [9]
    v = verify(logits, drafts, np.array([2], np.int32), s, np.arange(1))
    assert v.accepted.tolist() == [2] and v.tokens.tolist() == [6]
    assert np.allclose(v.logprobs[0], float(logits[2, 6] - torch.logsumexp(logits[2], -1)))


@pytest.mark.parametrize("top_k", [0, 3])
def test_rejection_sampling_keeps_the_distribution(top_k: int) -> None:
    """One draft (token 0) before each of 20,000 seeded rows: the first token out is the draft
    when kept, else a draw from the rest; its frequencies must follow the model's p (after
    top-k), and the second token's, given the draft was kept, p at the next position."""
    vocab, n = 6, 20_000
    first = torch.tensor([0.5, 0.1, 1.2, -0.3, 0.8, 0.0])
    second = torch.tensor([1.0, -1.0, 0.2, 0.7, -0.5, 0.3])
    logits = torch.stack([first, second]).repeat(n, 1)
    drafts = np.zeros(n, np.int32)
    seeds = np.random.default_rng(0).integers(0, 2**62, n, dtype=np.int64)
    v = verify(logits, drafts, np.ones(n, np.int32), batch(n, 1.0, seeds, top_k), np.arange(n))
    out_first = np.where(v.accepted == 1, 0, v.tokens)

    def expected(row: torch.Tensor) -> np.ndarray:
        p = torch.softmax(row, -1)
        if top_k:
            p = torch.where(row >= row.topk(top_k).values[-1], p, 0.0)
            p = p / p.sum()
        return p.double().numpy()

    for seen, p, count in (
        (out_first, expected(first), n),
        (v.tokens[v.accepted == 1], expected(second), int((v.accepted == 1).sum())),
    ):
        observed = np.bincount(seen, minlength=vocab)
        support = p > 0
        assert observed[~support].sum() == 0  # nothing outside top-k
        chi2 = float((((observed - count * p) ** 2)[support] / (count * p[support])).sum())
        # 99.9th percentile of chi-square with (support - 1) degrees of freedom, at most 5
        assert chi2 < {2: 13.82, 4: 18.47, 5: 20.52}[int(support.sum()) - 1], (chi2, observed, count * p)
    assert abs((v.accepted == 1).mean() - expected(first)[0]) < 0.02  # kept with probability p(draft)
