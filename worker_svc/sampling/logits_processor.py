"""Logit processing before sampling, from what the plan carries (the worker keeps no history).

Order, as vLLM applies it: logit bias (and min_tokens bans) -> repetition penalty ->
presence and frequency penalties -> a structured output's token mask (-inf on every token its
grammar does not allow next); the sampler then applies temperature, min-p, top-k, top-p.
Greedy rows see the processed logits too. Log-probabilities returned to clients are taken
from the raw logits, before any of this.

    repetition (transformers): for each token in prompt + output, logit / p if > 0, else * p
    presence   (OpenAI): logit - presence * [token occurs in the output]
    frequency  (OpenAI): logit - frequency * (occurrences in the output)

Only rows that use a feature pay for it: empty plan arrays mean "off for every row".
"""

from __future__ import annotations

import numpy as np
import torch

from common.plan import SamplingBatch
from kernels.token_mask import apply_token_bitmask_, apply_token_bitmask_reference
from worker_svc.device.host_copy import to_device


def process_logits(
    logits: torch.Tensor,  # float32 [len(rows), vocab], raw; not modified
    batch: SamplingBatch,
    rows: np.ndarray,  # which of the plan's sequences the logits rows belong to
) -> torch.Tensor:
    """The processed logits (a new tensor when anything applies, else `logits` itself)."""
    if not rows.size:
        return logits
    has_bias = batch.bias_offsets.size and int(batch.bias_offsets[-1]) > 0
    has_history = batch.history_offsets.size and int(batch.history_offsets[-1]) > 0
    mask_of = batch.mask_rows[rows] if batch.mask_rows.size else batch.mask_rows
    masked = np.flatnonzero(mask_of >= 0)
    if not has_bias and not has_history and not masked.size:
        return logits
    out = logits.clone()
    dev = logits.device
    if has_bias:
        r, t, v = _ragged(batch.bias_offsets, batch.bias_token_ids, rows, batch.bias_values)
        if r.size:
            # index_put_ with accumulate: a token listed twice gets both biases.
            out.index_put_((to_device(r, dev), to_device(t, dev)), to_device(v, dev), accumulate=True)
    if has_history:
        _penalize(out, batch, rows)
    if masked.size:
        apply_masks(out, masked, batch.token_masks[mask_of[masked]])
    return out


def apply_masks(out: torch.Tensor, rows: np.ndarray, masks: np.ndarray) -> None:
    """-inf on the tokens the grammar of each of `rows` does not allow (masks [len(rows), words])."""
    dev = out.device
    index = to_device(rows, dev)
    picked = out.index_select(0, index)  # [len(rows), vocab]
    masks_t = to_device(masks, dev)
    if dev.type == "cuda":
        apply_token_bitmask_(picked, masks_t)
    else:
        picked = apply_token_bitmask_reference(picked, masks_t)
    out.index_copy_(0, index, picked)


def processed_rows(batch: SamplingBatch, rows: np.ndarray, masks: bool = True) -> np.ndarray:
    """bool [len(rows)]: which of the plan rows `rows` have a bias, a penalized history or
    (with `masks`) a token mask."""
    touched = np.zeros(rows.size, dtype=bool)
    for offsets in (batch.bias_offsets, batch.history_offsets):
        if offsets.size and int(offsets[-1]) > 0:
            touched |= offsets[rows + 1] > offsets[rows]
    if masks and batch.mask_rows.size:
        touched |= batch.mask_rows[rows] >= 0
    return touched


def _ragged(
    offsets: np.ndarray, tokens: np.ndarray, rows: np.ndarray, values: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(logits row, token, value) triples of the plan rows `rows`, gathered from ragged arrays."""
    starts, ends = offsets[rows], offsets[rows + 1]
    counts = ends - starts
    which = np.repeat(np.arange(rows.size), counts)
    index = np.repeat(starts - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))
    vals = values[index] if values is not None else np.zeros(index.size, np.float32)
    return which.astype(np.int64), tokens[index].astype(np.int64), vals.astype(np.float32)


def _penalize(out: torch.Tensor, batch: SamplingBatch, rows: np.ndarray) -> None:
    dev = out.device
    n, vocab = out.shape
    offsets = batch.history_offsets
    which, tokens, _ = _ragged(offsets, batch.history_token_ids, rows)
    # Position of each history token inside its sequence: the last output_position are output.
    lengths = (offsets[rows + 1] - offsets[rows]).astype(np.int64)
    pos = np.arange(which.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    is_output = pos >= np.repeat(lengths - batch.output_position[rows].astype(np.int64), lengths)
    w = to_device(which, dev)
    t = to_device(tokens, dev)
    seen = torch.zeros((n, vocab), dtype=torch.bool, device=dev)
    seen[w, t] = True
    counts = torch.zeros((n, vocab), dtype=torch.float32, device=dev)
    # Output occurrences selected on the host: a boolean index on the device would wait for it.
    ow, ot = to_device(which[is_output], dev), to_device(tokens[is_output], dev)
    counts.index_put_((ow, ot), torch.ones(ow.shape[0], device=dev), accumulate=True)
    rep = to_device(batch.repetition_penalty[rows], dev)[:, None]
    penalized = torch.where(out > 0, out / rep, out * rep)
    out.copy_(torch.where(seen, penalized, out))
    presence = to_device(batch.presence_penalty[rows], dev)[:, None]
    frequency = to_device(batch.frequency_penalty[rows], dev)[:, None]
    out.sub_(presence * (counts > 0) + frequency * counts)
