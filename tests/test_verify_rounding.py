"""Speculative decoding in bfloat16 on the CPU: a verification step's rows give, bit for bit,
the logits of the decodes they stand for, so greedy outputs with and without drafts are the
same tokens (SmolLM2, the C++ kernels and the packed GEMMs, as a worker runs them).

Two things once broke it: oneDNN's single-row GEMM rounds some outputs otherwise than its
kernels for several rows (with oneDNN a lone decode runs as two rows, step_buckets.gemm_buckets;
our AVX512-BF16 GEMM, kernels/cpu/linear.cpp, gives a row the same bits in any batch and runs
it alone), and the attention kernel's paired-value path, which rounds probabilities to bfloat16
(only queries of a prompt's length take it, kernels/cpu/paged_attention.h).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from common.config import CacheConfig, WorkerConfig
from kernels.cpu_linear import own_kernel
from tests.plans import Feed, make_plan
from worker_svc.step.runner import ModelRunner


@pytest.fixture(scope="module")
def runner(smollm2_dir: Path) -> ModelRunner:
    config = WorkerConfig(
        model=str(smollm2_dir),
        dtype="bfloat16",
        device="cpu",
        attention_backend="cpu",
        cache=CacheConfig(block_size=16, num_gpu_blocks=64),
    )
    return ModelRunner(config)


@pytest.mark.slow
@pytest.mark.parametrize("verified", [6, 12])
def test_verification_rows_equal_the_decodes_bit_for_bit(runner: ModelRunner, verified: int) -> None:
    # With our GEMM nothing pads a step: the lone decodes below run as one row each.
    assert (runner._gemm_buckets is None) == own_kernel()
    prompt = np.random.default_rng(verified).integers(100, 40000, 37).tolist()
    alone, together = list(range(0, 8)), list(range(16, 24))
    # Decoding: the prompt, then one greedy token a step.
    tokens = [int(runner.logits(make_plan(0, [Feed(0, prompt, 0, alone)]))[-1].argmax())]
    decodes = []
    for i in range(verified):
        step = runner.logits(make_plan(1 + i, [Feed(0, [tokens[-1]], len(prompt) + i, alone)]))
        decodes.append(step[0])
        tokens.append(int(step[0].argmax()))
    # Verifying: the same prompt elsewhere, then those tokens in one step, as kept drafts are.
    runner.logits(make_plan(50, [Feed(1, prompt, 0, together)]))
    rows = runner.logits(make_plan(51, [Feed(1, tokens[:verified], len(prompt), together)]))
    for i in range(verified):
        assert torch.equal(rows[i], decodes[i]), f"row {i} of {verified}"
