"""The warm-up compiles every Triton kernel variant a later step can need.

Triton compiles one variant per specialisation key: the argument types, which integer
arguments equal 1 or are multiples of 16, which pointers are 16-byte aligned, every constexpr,
and the launch options. A step whose key the warm-up did not launch compiles on the spot
(seconds on a GPU), in some early request's step.

The interpreter compiles nothing, so each launch's key is computed here with Triton's own
binder for an sm_90 target, the function `JITFunction.run` looks its kernel cache up with.
A worker warms up as on CUDA, then runs steps of other shapes (numbers of sequences,
block-table widths, context lengths, token counts, a chunk beside decodes), with the split
heuristic seeing an H200's 132 SMs; every key those steps launch must be one the warm-up
launched. The model is a mixture of experts, so the grouped GEMMs are among the kernels, in
each of their row tiles. (With LoRA: tests/test_warm_up_lora.py.)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

from common.block_tables import BlockTables
from common.config import CacheConfig, WorkerConfig
from common.plan import SamplingBatch, StepPlan
from kernels import activation, fused_moe, kv_store, paged_attention, prefill_attention, rms_norm, rotary
from kernels.checks import interpreting
from tests.compile_kernels import worker_cases
from worker_svc.step.runner import ModelRunner

KERNELS = (
    paged_attention._decode_partial_kernel,
    paged_attention._decode_merge_kernel,
    prefill_attention._prefill_kernel,
    kv_store._store_kv_kernel,
    rms_norm._rms_norm_kernel,
    activation._silu_and_mul_kernel,
    rotary._rotary_kernel,
    fused_moe._grouped_gemm_kernel,
)
BLOCK_SIZE = 16
NUM_BLOCKS = 96
MAX_NUM_SEQS = 16
# Each step: (context, query tokens) per sequence, and the block-table width when it is wider
# than the longest sequence needs (None: exactly that).
STEPS: list[tuple[list[tuple[int, int]], int | None]] = [
    ([(4, 1)], None),  # decodes: one in a table one block wide
    ([(40, 1)] * 3, None),
    ([(30, 1)] * 2, 16),  # a table 16 blocks wide
    ([(1000, 1)], None),  # a long context: 16 splits
    ([(30, 1)] * 3, 100),  # 25 splits, from three sequences
    ([(20, 1)] * MAX_NUM_SEQS, None),  # one split
    ([(0, 7)], None),  # prompts: one sequence, 16-divisible counts, a chunk beside decodes
    ([(0, 16), (0, 16)], None),
    ([(32, 16)] + [(3, 1)] * (MAX_NUM_SEQS - 1), None),
    ([(0, 9), (100, 1), (17, 1)], 17),
    # Rows per expert that pick the grouped GEMMs' taller tiles (kernels.fused_moe.moe_block_m):
    ([(0, 65)] * 4, None),  # 130, the 64-row tile
    ([(0, 64)] * 8 + [(3, 1)], None),  # 256.5, the 128-row tile, a decode beside the prompts
]


def _model(path: Path) -> Path:
    """Mixtral with one expert per token, of two: a step of one token is one (token, expert)
    pair, and 256 tokens fill the 64-row tile (twice, for the mean expert)."""
    torch.manual_seed(0)
    cfg = MixtralConfig(
        vocab_size=300,
        hidden_size=96,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,  # head_dim 16: the decode workspace's views start at odd sizes
        num_key_value_heads=2,
        max_position_embeddings=4096,  # 256 blocks: tables wide enough for 64 splits
        num_local_experts=2,
        num_experts_per_tok=1,
        sliding_window=None,
        initializer_range=0.3,
    )
    MixtralForCausalLM(cfg).float().save_pretrained(str(path))
    return path


def _unspecialised(kernel: Any, option: str = "do_not_specialize") -> list[int | str]:
    """A kernel's do_not_specialize (or _on_alignment) list, interpreted or compiled."""
    given = kernel.kwargs[option] if interpreting() else getattr(kernel, option)
    return list(given or ())


class KernelKeys:
    """Records each launch's specialisation key, by kernel, and runs the launch."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, kernels: tuple[Any, ...] = KERNELS) -> None:
        self.keys: dict[str, set[str]] = defaultdict(set)
        backend = make_backend(GPUTarget("cuda", 90, 32))
        for kernel in kernels:
            options = {k: _unspecialised(kernel, k) for k in ("do_not_specialize", "do_not_specialize_on_alignment")}
            jit = JITFunction(kernel.fn, **options)
            binder = create_function_from_signature(jit.signature, jit.params, backend)
            monkeypatch.setattr(kernel, "run", self._recording(kernel.fn.__name__, binder, kernel.run))

    def _recording(self, name: str, binder: Callable[..., Any], run: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            _, specialization, options = binder(*args, **kwargs)
            self.keys[name].add(compute_cache_key({}, specialization, options))
            return run(*args, grid=grid, warmup=warmup, **kwargs)

        return recorded

    def take(self) -> dict[str, set[str]]:
        keys, self.keys = self.keys, defaultdict(set)
        return keys


def step_plan(seqs: list[tuple[int, int]], width: int | None) -> StepPlan:
    n = len(seqs)
    context = np.array([c for c, _ in seqs], np.int32)
    query = np.array([q for _, q in seqs], np.int32)
    needed = -(-(context + query) // BLOCK_SIZE)
    width = width or int(needed.max())
    tables = np.full((n, width), -1, np.int32)
    start = 0
    for i, blocks in enumerate(needed.tolist()):
        tables[i, :blocks] = np.arange(start, start + blocks) % NUM_BLOCKS  # what they name is not the key
        start += blocks
    return StepPlan(
        step_id=1,
        seq_ids=np.arange(n, dtype=np.int64),
        query_lens=query,
        context_lens=context,
        input_ids=np.ones(int(query.sum()), np.int32),
        block_tables=BlockTables.whole_rows(tables),
        sample=np.ones(n, np.uint8),
        sampling=SamplingBatch(
            temperature=np.zeros(n, np.float32),
            top_p=np.ones(n, np.float32),
            top_k=np.zeros(n, np.int32),
            seed=np.zeros(n, np.int64),
            output_position=np.zeros(n, np.int32),
        ),
    )


@pytest.mark.skipif(not interpreting(), reason="runs the kernels on CPU tensors, in the interpreter")
def test_steps_after_the_warm_up_launch_no_kernel_variant_it_did_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = KernelKeys(monkeypatch)
    monkeypatch.setattr(paged_attention, "_parallel_units", lambda device: 2 * 132)
    monkeypatch.setattr(ModelRunner, "_warms_up", lambda self: True)
    runner = ModelRunner(
        WorkerConfig(
            model=str(_model(tmp_path)),
            dtype="float32",
            device="cpu",
            attention_backend="triton",
            cache=CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks=NUM_BLOCKS, num_cpu_blocks=0),
            max_num_seqs=MAX_NUM_SEQS,
        )
    )
    warmed = recorder.take()
    for seqs, width in STEPS:
        runner.execute(step_plan(seqs, width))
    later = recorder.take()
    assert set(later) == {k.fn.__name__ for k in KERNELS}  # every kernel ran in those steps
    new = {name: keys - warmed.get(name, set()) for name, keys in later.items()}
    assert all(not keys for keys in new.values()), "\n".join(f"{n}: {k}" for n, ks in new.items() for k in ks)


def test_unspecialised_arguments_are_not_compiled_as_aligned() -> None:
    """The offline compile (tests/compile_kernels.py, benchmarks/kernel_resources.py) must
    measure the kernel a launch compiles: no argument it gives the divisibility hint may be
    one the launch leaves unspecialised."""
    for case in worker_cases((64, 128), ("bf16", "fp32"), (4096,)):
        unspecialised = set(_unspecialised(case.kernel))
        assert not unspecialised & case.aligned, (case.name, unspecialised & case.aligned)


@pytest.mark.parametrize("num_kv_heads", [1, 8])
def test_every_rank_runs_as_many_warm_up_steps_whatever_its_gpu(
    monkeypatch: pytest.MonkeyPatch, num_kv_heads: int
) -> None:
    """Warm-up steps hold collectives in a tensor-parallel group, so ranks on GPUs of other
    SM counts (whose split heuristic reaches other variants) must still run as many."""
    runner = SimpleNamespace(
        attention_backend="triton",
        shape=SimpleNamespace(num_heads=4 * num_kv_heads, num_kv_heads=num_kv_heads, head_dim=128),
        max_model_len=8192,
        block_size=16,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
        config=SimpleNamespace(max_num_seqs=256),
    )
    runner._decode_layout = partial(ModelRunner._decode_layout, runner)  # type: ignore[arg-type]
    counts, reached = set(), []
    for sms in (16, 78, 132, 264):
        monkeypatch.setattr(paged_attention, "_parallel_units", lambda device, sms=sms: 2 * sms)
        shapes = ModelRunner._warm_up_decodes(runner)  # type: ignore[arg-type]
        counts.add(len(shapes))
        reached.append(len(set(shapes)))
    assert counts == {len(paged_attention.MERGE_PADS)}
    assert len(set(reached)) > 1  # the devices do reach different variants
