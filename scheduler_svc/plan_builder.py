"""Turn the scheduler's choice for one step into a StepPlan of flat arrays.

This runs every step for up to `max_num_seqs` sequences, so it avoids per-sequence numpy
calls: each field is one list comprehension turned into one array, block tables are one
fancy-index copy from the block manager's mirror, and what cannot change between steps
(sampling parameters, seeds, prompt lengths, mirror rows) is reused while the step runs the
same sequences as the previous one, which is every decode step between admissions.
"""

from __future__ import annotations

import numpy as np

from common.plan import SamplingBatch, StepPlan
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.sequence import Sequence


class PlanBuilder:
    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self._ids: list[int] = []
        self._rows_epoch = -1
        self._static: dict[str, np.ndarray] = {}

    def build(self, step_id: int, seqs: list[Sequence], query_lens: list[int]) -> StepPlan:
        """Sequence i feeds tokens [computed, computed + query_lens[i]) of its token list."""
        bm = self.bm
        n = len(seqs)
        ids = [s.seq_id for s in seqs]
        if ids != self._ids:
            self._ids = ids
            self._static = _static_fields(seqs)
            self._rows_epoch = -1
        if self._rows_epoch != bm.rows_epoch:
            self._static["rows"] = bm.rows_of(ids)
            self._rows_epoch = bm.rows_epoch
        st = self._static
        q = np.array(query_lens, dtype=np.int32)
        computed = [s.num_computed_tokens for s in seqs]
        if n and max(query_lens) == 1:
            input_ids = np.array([s.token_ids[c] for s, c in zip(seqs, computed)], dtype=np.int32)
        else:
            flat: list[int] = []
            for s, c, k in zip(seqs, computed, query_lens):
                flat.extend(s.token_ids[c : c + k])
            input_ids = np.array(flat, dtype=np.int32)
        context_lens = np.array(computed, dtype=np.int32)
        num_tokens = np.array([len(s.token_ids) for s in seqs], dtype=np.int32)
        ends = context_lens + q
        swap_out, swap_in, copy = bm.take_ops()
        return StepPlan(
            step_id=step_id,
            seq_ids=st["seq_ids"],
            query_lens=q,
            context_lens=context_lens,
            input_ids=input_ids,
            # A sequence fed up to position e owns exactly ceil(e / block_size) blocks.
            block_tables=bm.tables_at(st["rows"], -(-ends // bm.block_size)),
            sample=(ends == num_tokens).astype(np.uint8),
            sampling=SamplingBatch(
                temperature=st["temperature"],
                top_p=st["top_p"],
                top_k=st["top_k"],
                seed=st["seed"],
                output_position=num_tokens - st["prompt_lens"],
                num_logprobs=st["num_logprobs"],
            ),
            swap_out=swap_out,
            swap_in=swap_in,
            copy=copy,
        )


def beam_candidates(seq: Sequence) -> int:
    """Candidates a beam step ranks per beam: (1 + stop tokens) x width, at least 2 x width, as
    in transformers, so that W candidates that do not end always remain."""
    width = seq.sampling.beam_width
    return (1 + max(1, len(seq.stop_ids))) * width if width > 1 else 0


def _static_fields(seqs: list[Sequence]) -> dict[str, np.ndarray]:
    params = [s.sampling for s in seqs]
    return {
        "seq_ids": np.array([s.seq_id for s in seqs], dtype=np.int64),
        "temperature": np.array([p.temperature for p in params], dtype=np.float32),
        "top_p": np.array([p.top_p for p in params], dtype=np.float32),
        "top_k": np.array([p.top_k for p in params], dtype=np.int32),
        "seed": np.array([s.seed for s in seqs], dtype=np.uint64).view(np.int64),
        "prompt_lens": np.array([len(s.prompt_token_ids) for s in seqs], dtype=np.int32),
        "num_logprobs": np.array([beam_candidates(s) for s in seqs], dtype=np.int32),
    }
