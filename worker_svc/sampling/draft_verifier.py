"""Speculative decoding's verification: how many of a sequence's draft tokens the model keeps.

A sequence with d drafts x1..xd is fed [t, x1, .., xd] in one step; its logits at those d + 1
positions give the model's distribution p_j for output position o + j. Draft x_{j+1} stands
at position j:

  - greedy rows keep it while it is p_j's argmax;
  - sampled rows keep it with probability p_j(x), p_j being the distribution sampling draws
    from (temperature, min-p, top-k, top-p applied). Prompt-lookup drafts are proposed with
    certainty (a one-hot draft distribution), so this is rejection sampling with q = 1 at x:
    the first rejected position draws instead from p_j with x removed, renormalised
    ((p - q)+ normalised); with every draft kept, the token after them is drawn from p_d.
    Each output token is then distributed exactly as p_j, as without drafts.

The randomness is a pure function of (seed, output position), as for every other draw
(worker_svc/sampling/sampler.py): the acceptance test uses a stream of its own (the seed with
its bits flipped), so a recomputed or re-batched sequence keeps or rejects the same drafts.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from common.plan import SamplingBatch
from worker_svc.device.host_copy import to_device, to_host
from worker_svc.sampling.logits_processor import apply_masks
from worker_svc.sampling.logprobs import logits_stats
from worker_svc.sampling.sampler import filtered_probs, inverse_cdf, uniform

# The acceptance test's stream: the seed with every bit flipped (int64 two's complement).
_ACCEPT_STREAM = -1


class Verdict(NamedTuple):
    tokens: np.ndarray  # int32 [rows]: the token after each row's accepted drafts
    accepted: np.ndarray  # int32 [rows]: drafts kept
    logprobs: np.ndarray  # float32 [rows]: the token's log-probability (raw distribution)
    draft_logprobs: np.ndarray  # float32 [sum(lens)]: each draft's log-probability at its position


def verify(
    logits: torch.Tensor,  # [sum(lens + 1), vocab] raw logits, each row's d + 1 positions in order
    drafts: np.ndarray,  # int32 [sum(lens)] the rows' drafts, row after row
    lens: np.ndarray,  # int32 [rows] drafts per row, each > 0
    s: SamplingBatch,
    plan_rows: np.ndarray,  # [rows] each row's index in the plan (its sampling parameters)
    cpu_kernels: Any = None,
) -> Verdict:
    """`cpu_kernels`: the argmax and logsumexp that plain decoding takes (logits_stats), so
    that a greedy row breaks a tie between equal bfloat16 logits the way it would without
    drafts. A row with a structured output's grammar has a mask for each of its d + 1
    positions, from s.mask_rows on: each position chooses from its masked float32 logits, as
    its decode would (logits_processor, sampler); log-probabilities stay raw."""
    dev = logits.device
    lens = lens.astype(np.int64)
    width = lens + 1
    first = np.cumsum(width) - width  # each row's first logits row
    row_of = np.repeat(np.arange(lens.size), width)
    j = np.arange(int(width.sum())) - first[row_of]  # a logits row's place in its row
    is_draft = j < lens[row_of]
    draft_at = np.zeros(j.size, np.int64)
    draft_at[is_draft] = drafts
    params = plan_rows[row_of]
    tokens, lse = logits_stats(logits, cpu_kernels)
    logits = logits.float()
    chosen_from = logits  # what each position draws from: the raw logits, or masked ones
    first_mask = s.mask_rows[params] if s.mask_rows.size else np.full(j.size, -1)
    masked = np.flatnonzero(first_mask >= 0)
    if masked.size:
        chosen_from = logits.clone()
        apply_masks(chosen_from, masked, s.token_masks[first_mask[masked] + j[masked]])
        index = to_device(masked, dev)
        tokens = tokens.index_copy(0, index, chosen_from.index_select(0, index).argmax(dim=-1).to(tokens.dtype))
    at = to_device(draft_at, dev)
    draft_lp = logits.gather(1, at[:, None]).squeeze(1) - lse
    keep = tokens == at
    random = np.flatnonzero(s.temperature[params] > 0)
    if random.size:
        p = params[random]
        min_p = s.min_p[p] if s.min_p.size else None
        probs = filtered_probs(chosen_from[to_device(random, dev)], s.temperature[p], s.top_p[p], s.top_k[p], min_p)
        index = to_device(random, dev)
        position = s.output_position[p].astype(np.int64) + j[random]
        u_keep = uniform(to_device(s.seed[p] ^ _ACCEPT_STREAM, dev), to_device(position, dev))
        x = at.index_select(0, index)
        keep[index] = u_keep < probs.gather(1, x[:, None]).squeeze(1).double()
        # Where a draft stands, the draw that replaces it leaves it out: (p - q)+ renormalised.
        residual = probs.clone()
        stand = to_device(np.flatnonzero(is_draft[random]), dev)
        residual[stand, x.index_select(0, stand)] = 0.0
        tokens[index] = inverse_cdf(residual, uniform(to_device(s.seed[p], dev), to_device(position, dev)))
    token_lp = logits.gather(1, tokens[:, None]).squeeze(1) - lse
    keep_h, tokens_h, token_lp_h, draft_lp_h = to_host(keep, tokens, token_lp, draft_lp)
    # Drafts kept: up to the first rejected one (the bonus position never rejects).
    rejected = ~keep_h.astype(bool) & is_draft
    accepted = np.array(
        [int(np.argmax(rejected[f : f + w])) if rejected[f : f + w].any() else w - 1 for f, w in zip(first, width)],
        dtype=np.int64,
    )
    final = first + accepted
    return Verdict(
        tokens_h[final].astype(np.int32),
        accepted.astype(np.int32),
        token_lp_h[final].astype(np.float32),
        draft_lp_h[is_draft].astype(np.float32),
    )
