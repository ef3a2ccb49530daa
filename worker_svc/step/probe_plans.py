"""Plans a worker runs on itself before it serves: the heaviest step it can be sent, whose
memory peak sizes the KV cache on CUDA (with the torch attention path, also the widest
decode, whose gathered contexts can outweigh it), and a small decode step that compiles the
decode kernels before the first request needs them, beside prompt steps long enough for the
experts' taller row tiles (`prompt_rows`). Where the worker has adapter slots they also run
through one (`through_slot`): the empty slot `zero_adapter` passes off as an adapter.

The heaviest step is the one the scheduler can build at the worker's limits: a prompt chunk
filling the token budget beside as many other rows as `max_num_seqs` allows, every row
sampled through every path that allocates: temperature, min-p, top-k and top-p (a sort of
the whole vocabulary), logit bias, the three penalties over a history, the most alternatives
a client may ask (`PROFILE_LOGPROBS`), and prompt log-probabilities of the chunk.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from common.block_tables import BlockTables
from common.plan import SamplingBatch, StepPlan
from worker_svc.lora.lora_slots import TARGETS, LoraSlots

# The scheduler's default --max-logprobs; beam search asks 2 x beam_width, as many at 10 beams.
PROFILE_LOGPROBS = 20


def heaviest_step(tokens: int, max_num_seqs: int, block_size: int, vocab_size: int) -> tuple[StepPlan, int]:
    """(plan, blocks its table uses): one chunk of the rest of `tokens` and up to
    `max_num_seqs - 1` one-token rows, every row sampled with everything on."""
    n = max(1, min(max_num_seqs, tokens))
    query_lens = np.ones(n, np.int32)
    query_lens[0] = tokens - (n - 1)
    blocks_of = -(-query_lens // block_size)
    # Row after row over blocks 0, 1, 2, ...: every row its own blocks.
    offsets = np.concatenate([[0], np.cumsum(blocks_of)]).astype(np.int32)
    tables = BlockTables(offsets, np.arange(offsets[-1], dtype=np.int32))
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
    return _greedy(BlockTables.whole_rows(tables), np.ones(num_seqs, np.int32), context, vocab_size)


def widest_decode_step(rows: int, context: int, block_size: int, vocab_size: int, num_blocks: int) -> StepPlan:
    """`rows` sequences each decoding one token after `context` tokens: what the torch
    attention path gathers the most for (it copies each decoding row's whole context, padded
    to the longest). The block tables cycle over `num_blocks` blocks, since the gather's size
    depends on the table widths, not on which blocks they name."""
    width = -(-(context + 1) // block_size)
    tables = (np.arange(rows * width, dtype=np.int32) % num_blocks).reshape(rows, width)
    return _greedy(BlockTables.whole_rows(tables), np.ones(rows, np.int32), context, vocab_size)


def prompt_rows(
    tokens: int, max_rows: int, max_len: int, block_size: int, vocab_size: int, num_blocks: int
) -> StepPlan:
    """A step of `tokens` prompt tokens spread evenly over up to `max_rows` rows (more only
    where a row would pass `max_len`, the model's context), each row's last one sampled
    greedily: short rows keep the causal attention's work small. The tables cycle over the
    cache's `num_blocks`: before a worker serves, what its keys overwrite is no sequence's."""
    rows = max(min(max_rows, tokens), -(-tokens // max_len))
    query_lens = np.full(rows, tokens // rows, np.int32)
    query_lens[: tokens % rows] += 1
    width = -(-int(query_lens.max()) // block_size)
    tables = (np.arange(rows * width, dtype=np.int32) % num_blocks).reshape(rows, width)
    return _greedy(BlockTables.whole_rows(tables), query_lens, 0, vocab_size)


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


def through_slot(plan: StepPlan, slot: int) -> StepPlan:
    """`plan` with every row through the adapter in LoRA slot `slot` (loaded before: the plan
    loads nothing), so the LoRA kernels compile and allocate in it as in an adapted step."""
    return dataclasses.replace(plan, lora_slots=np.full(plan.num_seqs, slot, np.int32))


@contextmanager
def zero_adapter(lora: LoraSlots) -> Iterator[int]:
    """Slot 0 passed off as an adapter of every module at the slots' rank, before any load:
    the LoRA kernels do their whole work (memory, compiles) and add 0, as an unfilled slot
    holds zero weights and scale. After it the slot is empty again (a plan naming it without
    a load is refused) and the step's slots are cleared: the decode graphs, captured after
    the probes and the warm-up, would record an adapted linear."""
    if any(held is not None for held in lora.loaded):
        raise RuntimeError("a zero adapter needs adapter slots that no load has filled")
    slot = 0
    lora.loaded[slot], lora.targets[slot] = ("", 0), frozenset(TARGETS)
    lora.ranks[slot] = lora.config.max_lora_rank  # the torch path's products at full size
    try:
        yield slot
    finally:
        lora.loaded[slot], lora.targets[slot], lora.ranks[slot] = None, frozenset(), 0
        lora.begin_step(None)


def _greedy(tables: BlockTables, query_lens: np.ndarray, context: int, vocab_size: int) -> StepPlan:
    """Each row of `tables` feeding its `query_lens` tokens after `context` cached ones, its
    last one sampled greedily."""
    n = tables.num_rows
    return StepPlan(
        step_id=0,
        seq_ids=np.arange(n, dtype=np.int64),
        query_lens=query_lens,
        context_lens=np.full(n, context, np.int32),
        input_ids=np.full(int(query_lens.sum()), min(1, vocab_size - 1), np.int32),
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
