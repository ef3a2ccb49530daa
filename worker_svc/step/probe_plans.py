"""Plans a worker runs on itself before it serves: the heaviest step it can be sent, whose
memory peak sizes the KV cache on CUDA (with the torch attention path, also the widest
decode, whose gathered contexts can outweigh it), and a small decode step that compiles the
decode kernels before the first request needs them.

The heaviest step is the one the scheduler can build at the worker's limits: a prompt chunk
filling the token budget beside as many other rows as `max_num_seqs` allows, every row
sampled through every path that allocates: temperature, min-p, top-k and top-p (a sort of
the whole vocabulary), logit bias, the three penalties over a history, the most alternatives
a client may ask (`PROFILE_LOGPROBS`), and prompt log-probabilities of the chunk.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from common.plan import SamplingBatch, StepPlan

# The scheduler's default --max-logprobs; beam search asks 2 x beam_width, as many at 10 beams.
PROFILE_LOGPROBS = 20


def heaviest_step(tokens: int, max_num_seqs: int, block_size: int, vocab_size: int) -> tuple[StepPlan, int]:
    """(plan, blocks its table uses): one chunk of the rest of `tokens` and up to
    `max_num_seqs - 1` one-token rows, every row sampled with everything on."""
    n = max(1, min(max_num_seqs, tokens))
    query_lens = np.ones(n, np.int32)
    query_lens[0] = tokens - (n - 1)
    blocks_of = -(-query_lens // block_size)
    width = int(blocks_of.max())
    tables = np.full((n, width), -1, np.int32)
    first = np.concatenate([[0], np.cumsum(blocks_of)[:-1]])
    for i in range(n):
        tables[i, : blocks_of[i]] = np.arange(first[i], first[i] + blocks_of[i])
    rng = np.random.default_rng(0)
    input_ids = rng.integers(0, vocab_size, tokens, dtype=np.int32)
    # Each row's history is its prompt (the penalties' seen/count tensors are [rows, vocab]
    # whatever the history's length); one biased token per row.
    history_offsets = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    prompt_logprobs = np.full(n, -1, np.int32)
    prompt_logprobs[0] = PROFILE_LOGPROBS
    sampling = SamplingBatch(
        temperature=np.ones(n, np.float32),
        top_p=np.full(n, 0.9, np.float32),
        top_k=np.full(n, 50, np.int32),
        seed=np.arange(n, dtype=np.int64),
        output_position=np.zeros(n, np.int32),
        num_logprobs=np.full(n, PROFILE_LOGPROBS, np.int32),
        min_p=np.full(n, 0.05, np.float32),
        repetition_penalty=np.full(n, 1.1, np.float32),
        presence_penalty=np.full(n, 0.5, np.float32),
        frequency_penalty=np.full(n, 0.5, np.float32),
        bias_offsets=np.arange(n + 1, dtype=np.int32),
        bias_token_ids=rng.integers(0, vocab_size, n, dtype=np.int32),
        bias_values=np.full(n, 1.0, np.float32),
        history_offsets=history_offsets,
        history_token_ids=input_ids.copy(),
        prompt_logprobs=prompt_logprobs,
        prompt_next_token=np.full(n, -1, np.int32),
    )
    plan = StepPlan(
        step_id=0,
        seq_ids=np.arange(n, dtype=np.int64),
        query_lens=query_lens,
        context_lens=np.zeros(n, np.int32),
        input_ids=input_ids,
        block_tables=tables,
        sample=np.ones(n, np.uint8),
        sampling=sampling,
    )
    return plan, int(blocks_of.sum())


def decode_step(block_size: int, vocab_size: int, num_seqs: int = 1, width: int = 2) -> StepPlan:
    """`num_seqs` sequences each decoding one token after a block and a half of context (less
    in a table one block wide), all in blocks 0-1, through block tables `width` wide (-1 past
    block 1): the width and the row count, not the contents, pick the decode kernel's split."""
    context = min(block_size + block_size // 2, width * block_size - 1)
    tables = np.full((num_seqs, width), -1, np.int32)
    tables[:, : min(width, 2)] = np.arange(min(width, 2), dtype=np.int32)
    return _greedy_decode(tables, context, vocab_size)


def widest_decode_step(rows: int, context: int, block_size: int, vocab_size: int, num_blocks: int) -> StepPlan:
    """`rows` sequences each decoding one token after `context` tokens: what the torch
    attention path gathers the most for (it copies each decoding row's whole context, padded
    to the longest). The block tables cycle over `num_blocks` blocks, since the gather's size
    depends on the table widths, not on which blocks they name."""
    width = -(-(context + 1) // block_size)
    return _greedy_decode(
        (np.arange(rows * width, dtype=np.int32) % num_blocks).reshape(rows, width), context, vocab_size
    )


def with_open_masks(plan: StepPlan, vocab_size: int) -> StepPlan:
    """`plan` with a structured output's token mask on every row, allowing every token: the
    mask kernel compiles in the warm-up too, not in the first constrained request's step."""
    words = -(-vocab_size // 32)
    sampling = dataclasses.replace(
        plan.sampling,
        mask_rows=np.arange(plan.num_seqs, dtype=np.int32),
        token_masks=np.full((plan.num_seqs, words), -1, np.int32),
    )
    return dataclasses.replace(plan, sampling=sampling)


def _greedy_decode(tables: np.ndarray, context: int, vocab_size: int) -> StepPlan:
    """One greedy token for each row of `tables`, after `context` cached tokens."""
    n = tables.shape[0]
    return StepPlan(
        step_id=0,
        seq_ids=np.arange(n, dtype=np.int64),
        query_lens=np.ones(n, np.int32),
        context_lens=np.full(n, context, np.int32),
        input_ids=np.full(n, min(1, vocab_size - 1), np.int32),
        block_tables=tables,
        sample=np.ones(n, np.uint8),
        sampling=SamplingBatch(
            temperature=np.zeros(n, np.float32),
            top_p=np.ones(n, np.float32),
            top_k=np.zeros(n, np.int32),
            seed=np.zeros(n, np.int64),
            output_position=np.zeros(n, np.int32),
        ),
    )
