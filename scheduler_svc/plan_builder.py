"""Turn the scheduler's choice for one step into a StepPlan of flat arrays.

This runs every step for up to `max_num_seqs` sequences, so it reads each sequence's fields
once into numpy arrays and takes the block tables from the block manager's array mirror in
one fancy-index copy; no per-sequence numpy calls.
"""

from __future__ import annotations

import numpy as np

from common.plan import SamplingBatch, StepPlan
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.sequence import Sequence


def build_plan(step_id: int, seqs: list[Sequence], query_lens: list[int], bm: BlockManager) -> StepPlan:
    """Sequence i feeds tokens [computed, computed + query_lens[i]) of its token list."""
    n = len(seqs)
    q = np.array(query_lens, dtype=np.int32)
    computed = [s.num_computed_tokens for s in seqs]
    if n and int(q.max()) == 1:
        input_ids = np.array([s.token_ids[c] for s, c in zip(seqs, computed)], dtype=np.int32)
    else:
        flat: list[int] = []
        for s, c, k in zip(seqs, computed, query_lens):
            flat.extend(s.token_ids[c : c + k])
        input_ids = np.array(flat, dtype=np.int32)
    context_lens = np.array(computed, dtype=np.int32)
    num_tokens = np.array([len(s.token_ids) for s in seqs], dtype=np.int32)
    prompt_lens = np.array([len(s.prompt_token_ids) for s in seqs], dtype=np.int32)
    params = [s.sampling for s in seqs]
    swap_out, swap_in, copy = bm.take_ops()
    return StepPlan(
        step_id=step_id,
        seq_ids=np.array([s.seq_id for s in seqs], dtype=np.int64),
        query_lens=q,
        context_lens=context_lens,
        input_ids=input_ids,
        block_tables=bm.block_tables([s.seq_id for s in seqs]),
        sample=(context_lens + q == num_tokens).astype(np.uint8),
        sampling=SamplingBatch(
            temperature=np.array([p.temperature for p in params], dtype=np.float32),
            top_p=np.array([p.top_p for p in params], dtype=np.float32),
            top_k=np.array([p.top_k for p in params], dtype=np.int32),
            seed=np.array([s.seed for s in seqs], dtype=np.uint64).view(np.int64),
            output_position=num_tokens - prompt_lens,
            # A beam step ranks 2W candidates of every beam.
            num_logprobs=np.array([2 * p.beam_width if p.beam_width > 1 else 0 for p in params], dtype=np.int32),
        ),
        swap_out=swap_out,
        swap_in=swap_in,
        copy=copy,
    )
