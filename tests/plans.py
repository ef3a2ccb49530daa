"""Building StepPlans by hand for worker tests."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.block_tables import BlockTables
from common.plan import SamplingBatch, StepPlan


@dataclass
class Feed:
    seq_id: int
    token_ids: list[int]  # tokens fed this step
    context_len: int  # tokens already cached
    block_table: list[int]
    sample: bool = True
    temperature: float = 0.0
    seed: int = 0
    output_position: int = 0


def make_plan(step_id: int, feeds: list[Feed]) -> StepPlan:
    n = len(feeds)
    tables = BlockTables.from_rows([f.block_table for f in feeds])
    return StepPlan(
        step_id=step_id,
        seq_ids=np.array([f.seq_id for f in feeds], np.int64),
        query_lens=np.array([len(f.token_ids) for f in feeds], np.int32),
        context_lens=np.array([f.context_len for f in feeds], np.int32),
        input_ids=np.array([t for f in feeds for t in f.token_ids], np.int32),
        block_tables=tables,
        sample=np.array([f.sample for f in feeds], np.uint8),
        sampling=SamplingBatch(
            temperature=np.array([f.temperature for f in feeds], np.float32),
            top_p=np.ones(n, np.float32),
            top_k=np.zeros(n, np.int32),
            seed=np.array([f.seed for f in feeds], np.int64),
            output_position=np.array([f.output_position for f in feeds], np.int32),
        ),
    )
