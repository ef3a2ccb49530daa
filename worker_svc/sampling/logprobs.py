"""Log-probabilities returned with the sampled tokens.

They come from the model's unmodified distribution, log_softmax of the raw float32 logits,
never from the temperature- or top-p-shaped one the token was drawn from: a client (or the
scheduler's beam search) compares them across requests with different sampling parameters.

Result layout for a plan of n sequences, of which `rows` sampled, asking for `num_logprobs`:

    logprobs       [n]      the sampled token's log-probability; NaN where nothing was sampled
    top_token_ids  [n, K]   K = max(num_logprobs[rows]); the row's best tokens, best first,
    top_logprobs   [n, K]   padded with -1 / -inf past the row's own num_logprobs
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from common.plan import F32, I32
from worker_svc.device.host_copy import to_device


def logits_stats(logits: torch.Tensor, cpu_kernels: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 argmax, float32 logsumexp) per row of raw logits [rows, vocab], of any float dtype.

    A token's log-probability is then logits[r, t] - logsumexp[r], with no float32 copy of the
    logits and no log_softmax over them. `cpu_kernels` (kernels.cpu_ops) does it in one pass.
    """
    if cpu_kernels is not None and logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16):
        return cpu_kernels.logits_stats(logits)
    wide = logits.float()
    return wide.argmax(dim=-1), torch.logsumexp(wide, dim=-1)


def logprob_tensors(
    logits: torch.Tensor,  # [len(rows), vocab], raw, any float dtype
    lse: torch.Tensor,  # float32 [len(rows)] logsumexp of each row (logits_stats)
    tokens: torch.Tensor,  # int64 [len(rows)] the sampled tokens
    rows: np.ndarray,  # [len(rows)] which of the plan's sequences sampled
    num_logprobs: I32,  # [n] or empty (0 for every sequence)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """On the logits' device: (the sampled tokens' log-probabilities [len(rows)], the best
    alternatives' log-probabilities and ids [rows asking, K], best first), K the most any
    sampled row asks; `logprob_arrays` lays them out once they are on the host."""
    asked = num_logprobs[rows] if num_logprobs.size else np.zeros(len(rows), np.int32)
    width = int(asked.max()) if asked.size else 0
    chosen = logits.gather(1, tokens.view(-1, 1)).squeeze(1).float() - lse
    if not width:
        empty = logits.new_zeros((0, 0), dtype=torch.float32)
        return chosen, empty, empty.long()
    index = to_device(np.flatnonzero(asked > 0), logits.device)
    # The most likely tokens are the largest logits; log-probabilities are logits - lse.
    values, ids = logits.index_select(0, index).float().topk(width, dim=-1)
    return chosen, values - lse.index_select(0, index)[:, None], ids


def logprob_arrays(
    chosen: F32,  # [len(rows)] from logprob_tensors, on the host
    top_values: F32,  # [rows asking, K]
    top_ids: np.ndarray,  # int64 [rows asking, K]
    rows: np.ndarray,
    num_logprobs: I32,
    num_seqs: int,
) -> tuple[F32, I32, F32]:
    """(logprobs, top_token_ids, top_logprobs) of the whole plan (layout in the module doc)."""
    out = np.full(num_seqs, np.nan, np.float32)
    asked = num_logprobs[rows] if num_logprobs.size else np.zeros(len(rows), np.int32)
    width = int(asked.max()) if asked.size else 0
    ids = np.full((num_seqs, width), -1, np.int32)
    lps = np.full((num_seqs, width), -np.inf, np.float32)
    if not len(rows):
        return out, ids, lps
    out[rows] = chosen
    if width:
        asking = np.flatnonzero(asked > 0)
        keep = np.arange(width)[None, :] < asked[asking, None]  # a row's own num_logprobs
        ids[rows[asking]] = np.where(keep, top_ids, -1)
        lps[rows[asking]] = np.where(keep, top_values, -np.inf)
    return out, ids, lps


_SLICE = 256  # prompt positions scored at once


def prompt_logprobs(
    logits_of: Callable[[torch.Tensor], torch.Tensor],  # hidden rows -> float32 logits
    hidden: torch.Tensor,  # [num_tokens, hidden] of the whole step
    starts: np.ndarray,  # [num_seqs + 1] query start offsets
    input_ids: np.ndarray,  # [num_tokens]
    asked: np.ndarray,  # int32 [num_seqs]: alternatives per sequence, -1 = none
    next_token: np.ndarray,  # int32 [num_seqs]: prompt token after each chunk, -1 = none
) -> tuple[I32, F32, I32, F32]:
    """(offsets, logprobs, top ids, top logprobs) of every fed prompt position's next token.

    Position t of a chunk scores the token fed at t + 1; the chunk's last position scores
    next_token (nothing when the chunk ends the prompt: what follows is output).
    """
    n = asked.shape[0]
    rows: list[int] = []
    targets: list[int] = []
    counts = np.zeros(n + 1, np.int32)
    for i in np.flatnonzero(asked >= 0):
        begin, end = int(starts[i]), int(starts[i + 1])
        follow = list(input_ids[begin + 1 : end])
        if next_token[i] >= 0:
            follow.append(int(next_token[i]))
        rows.extend(range(begin, begin + len(follow)))
        targets.extend(follow)
        counts[i + 1] = len(follow)
    offsets = np.cumsum(counts, dtype=np.int32)
    width = int(asked.max()) if n else 0
    if not rows:
        return (
            offsets,
            np.zeros(0, np.float32),
            np.zeros((0, max(width, 0)), np.int32),
            np.zeros((0, max(width, 0)), np.float32),
        )
    dev = hidden.device
    chosen = np.empty(len(rows), np.float32)
    top_ids = np.full((len(rows), max(width, 0)), -1, np.int32)
    top_lps = np.full((len(rows), max(width, 0)), -np.inf, np.float32)
    per_entry = np.repeat(asked, np.diff(offsets))  # each entry's own row limit
    # In slices: a whole prefill chunk's [tokens, vocab] float32 logits would dwarf the step's
    # profiled peak (2048 x 128k vocab is 1 GiB, twice with the log-softmax).
    for a in range(0, len(rows), _SLICE):
        b = min(a + _SLICE, len(rows))
        index = to_device(np.asarray(rows[a:b], np.int64), dev)
        lps = torch.log_softmax(logits_of(hidden.index_select(0, index)).float(), dim=-1)
        chosen[a:b] = (
            lps.gather(1, to_device(np.asarray(targets[a:b], np.int64), dev).view(-1, 1)).squeeze(1).cpu().numpy()
        )
        if width > 0:
            values, ids = lps.topk(width, dim=-1)
            keep = np.arange(width)[None, :] < per_entry[a:b, None]
            top_ids[a:b] = np.where(keep, ids.cpu().numpy(), -1)
            top_lps[a:b] = np.where(keep, values.cpu().numpy(), -np.inf)
    return offsets, chosen, top_ids, top_lps
