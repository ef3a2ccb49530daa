"""Token sampling whose randomness depends only on (seed, output position).

The worker holds no generator state: each sampled sequence draws one uniform number
u = hash(seed, position), and picks the token where u falls in the cumulative distribution
(inverse-CDF sampling). A seeded request therefore gets the same token whatever batch it is
in, on any worker, after a recompute or a restart. The hash is integer arithmetic on int64
tensors that never overflows, so CPU and CUDA agree bit for bit.

Order of the filters: temperature, then min-p, then top-k, then top-p (bias and penalties come
before, in `logits_processor`). Rows that use
neither top-k nor top-p walk the distribution in vocabulary order; the others in descending
probability order. The choice depends on the row's own parameters only, never on its
neighbours in the batch.
"""

from __future__ import annotations

import numpy as np
import torch

from worker_svc.device.host_copy import to_device

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x < 2^32, in two 16-bit halves so int64 never overflows."""
    lo = (x & 0xFFFF) * c
    hi = ((x >> 16) * c) & 0xFFFF
    return (lo + (hi << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer: a bijection that spreads every input bit."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def uniform(seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """One float64 in (0, 1) per row, a pure function of (seed, position). seed: int64 bits."""
    seed_lo = seed & _M32
    seed_hi = (seed >> 32) & _M32
    x = _mix32(seed_lo ^ _mix32(seed_hi ^ _mix32(position.to(torch.int64) ^ 0x9E3779B9)))
    bits = (_mix32(x ^ 0x7F4A7C15) & 0xFFFFF) * 4294967296 + _mix32(x ^ 0x2545F491)  # 52 random bits
    return (bits.to(torch.float64) + 0.5) / float(1 << 52)


def sample(
    logits: torch.Tensor,  # float32 [n, vocab]
    temperature: np.ndarray,  # float32 [n], 0 = greedy
    top_p: np.ndarray,  # float32 [n], 1 = off
    top_k: np.ndarray,  # int32 [n], 0 = off
    seed: np.ndarray,  # int64 [n]
    position: np.ndarray,  # int32 [n]
    min_p: np.ndarray | None = None,  # float32 [n], 0 = off; None = off for every row
) -> torch.Tensor:
    """Returns int64 [n] token ids, on the logits' device.

    The parameters are host arrays (the plan's): which rows take which path is decided on
    the host, so on CUDA nothing here waits for the device.
    """
    tokens = logits.argmax(dim=-1)
    temperature, top_p, top_k = np.asarray(temperature), np.asarray(top_p), np.asarray(top_k)
    random = np.flatnonzero(temperature > 0)
    if not random.size:
        return tokens
    dev = logits.device

    def put(a: np.ndarray) -> torch.Tensor:
        return to_device(np.asarray(a)[random], dev)

    rows = to_device(random, dev)
    scaled = logits.index_select(0, rows) / put(temperature)[:, None]
    if min_p is not None and bool((np.asarray(min_p)[random] > 0).any()):
        # min-p on the temperature-scaled distribution, before top-k and top-p (vLLM's order).
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < put(min_p)[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    u = uniform(put(seed), put(position))
    truncated = (top_k[random] > 0) | (top_p[random] < 1)
    picked = torch.empty(random.size, dtype=torch.int64, device=dev)
    plain = np.flatnonzero(~truncated)
    if plain.size:
        at = to_device(plain, dev)
        picked[at] = inverse_cdf(torch.softmax(scaled[at], dim=-1), u[at])
    trunc = np.flatnonzero(truncated)
    if trunc.size:
        at = to_device(trunc, dev)
        picked[at] = _sample_truncated(scaled[at], put(top_k)[at], put(top_p)[at], u[at])
    tokens[rows] = picked
    return tokens


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index where u (scaled to the row's total mass) falls in each row's cumulative sum."""
    cdf = probs.double().cumsum(dim=-1)
    target = (u * cdf[:, -1]).unsqueeze(1)
    index = torch.searchsorted(cdf, target).squeeze(1)
    return index.clamp_(max=probs.shape[-1] - 1)


def _sample_truncated(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab).to(torch.int64)
    sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it
    # already reaches top_p. The most likely token is always kept.
    before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill((before >= top_p[:, None]) & (rank > 0), 0.0)
    return order.gather(1, inverse_cdf(probs, u).unsqueeze(1)).squeeze(1)


def filtered_probs(
    logits: torch.Tensor,  # float32 [n, vocab], raw
    temperature: np.ndarray,  # float32 [n], > 0
    top_p: np.ndarray,
    top_k: np.ndarray,
    min_p: np.ndarray | None = None,
) -> torch.Tensor:
    """float32 [n, vocab]: the distribution `sample` draws each row from (temperature, then
    min-p, top-k and top-p, as there), in vocabulary order; for speculative decoding, which
    weighs a draft token by its probability under it."""
    dev = logits.device
    scaled = logits / to_device(np.asarray(temperature, np.float32), dev)[:, None]
    if min_p is not None and bool((np.asarray(min_p) > 0).any()):
        probs = torch.softmax(scaled, dim=-1)
        floor = to_device(np.asarray(min_p, np.float32), dev)[:, None] * probs.max(dim=-1, keepdim=True).values
        scaled = scaled.masked_fill(probs < floor, float("-inf"))
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    vocab = scaled.shape[-1]
    rank = torch.arange(vocab, device=dev)[None, :]
    k = to_device(np.where(np.asarray(top_k) > 0, np.minimum(top_k, vocab), vocab).astype(np.int64), dev)
    probs = torch.softmax(sorted_logits.masked_fill(rank >= k[:, None], float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill((before >= to_device(np.asarray(top_p, np.float32), dev)[:, None]) & (rank > 0), 0.0)
    return torch.zeros_like(probs).scatter_(1, order, probs)
