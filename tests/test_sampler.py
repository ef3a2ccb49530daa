"""Sampling: greedy is argmax, randomness is a pure function of (seed, position)."""

from __future__ import annotations

import numpy as np
import torch

from worker_svc.sampling.sampler import sample, uniform


def batch(n: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0) -> dict[str, np.ndarray]:
    # Host arrays, as the plan carries them.
    return dict(
        temperature=np.full(n, temperature, np.float32),
        top_p=np.full(n, top_p, np.float32),
        top_k=np.full(n, top_k, np.int32),
        seed=np.arange(n, dtype=np.int64),
        position=np.zeros(n, np.int32),
    )


def test_greedy_is_argmax() -> None:
    logits = torch.randn(5, 100)
    assert torch.equal(sample(logits, **batch(5, temperature=0.0)), logits.argmax(-1))


def test_uniform_is_a_pure_function_of_seed_and_position() -> None:
    seeds = torch.tensor([0, 1, 2**62, -(2**63), 12345])
    pos = torch.tensor([0, 5, 7, 1, 100], dtype=torch.int32)
    u = uniform(seeds, pos)
    assert torch.equal(u, uniform(seeds, pos))
    assert ((u > 0) & (u < 1)).all()
    # one row alone draws what it draws inside the batch
    assert torch.equal(uniform(seeds[3:4], pos[3:4]), u[3:4])
    assert len(set(u.tolist())) == 5
    many = uniform(torch.arange(50_000), torch.zeros(50_000, dtype=torch.int32))
    assert abs(many.mean().item() - 0.5) < 0.01


def test_seeded_row_draws_the_same_token_whatever_its_neighbours() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 300)
    b = batch(8)
    b["top_p"][1::2] = 0.9  # neighbours with other filters must not change row 0's path
    b["top_k"][2] = 5
    full = sample(logits, **b)
    for i in range(8):
        alone = sample(logits[i : i + 1], **{k: v[i : i + 1] for k, v in b.items()})
        assert alone.item() == full[i].item()


def test_samples_follow_the_softmax_distribution() -> None:
    torch.manual_seed(1)
    probs_logits = torch.randn(1, 20) * 2
    n = 40_000
    b = batch(n, temperature=0.7)
    tokens = sample(probs_logits.repeat(n, 1), **b)
    freq = torch.bincount(tokens, minlength=20).double() / n
    expected = torch.softmax(probs_logits[0].double() / 0.7, -1)
    assert (freq - expected).abs().max().item() < 0.01


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    n = 5_000
    top_k = sample(logits.repeat(n, 1), **batch(n, top_k=2))
    assert set(top_k.tolist()) == {0, 1}
    probs = torch.softmax(logits[0], -1)  # ~[.64, .23, .09, ...]
    top_p = sample(logits.repeat(n, 1), **batch(n, top_p=0.8))
    assert set(top_p.tolist()) == {0, 1}  # .64 < .8 <= .64 + .23
    freq0 = (top_p == 0).double().mean().item()
    assert abs(freq0 - (probs[0] / (probs[0] + probs[1])).item()) < 0.03
    tiny_p = sample(logits.repeat(100, 1), **batch(100, top_p=0.01))
    assert set(tiny_p.tolist()) == {0}  # the most likely token always survives
