"""With adapter slots, the warm-up compiles the LoRA kernels too, and leaves the slots as it
found them.

The machinery of tests/test_warm_up_variants.py: each launch's specialisation key computed
with Triton's binder for an sm_90 target. A dense Llama (every linear adaptable: the q, k and
v parts of qkv_proj, o_proj, the gate and up parts of gate_up_proj, down_proj) warms up with
LoRA enabled, then runs adapted steps of varied shapes: one adapter or three, of ranks below
the slots' and at it, targeting some modules or all, beside base rows, prompts, a chunk
beside decodes; none may launch a key the warm-up did not.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from common.config import CacheConfig, LoraConfig, WorkerConfig
from common.plan import AdapterLoad, StepPlan
from kernels import lora, paged_attention
from kernels.checks import interpreting
from tests.adapters import ATTENTION, MLP, make_peft_adapter, save_small_llama
from tests.plans import Feed, make_plan
from tests.test_warm_up_variants import BLOCK_SIZE, KERNELS, MAX_NUM_SEQS, NUM_BLOCKS, KernelKeys, step_plan
from worker_svc.step.runner import ModelRunner, PlanError

LORA_KERNELS = (lora._lora_shrink_kernel, lora._lora_expand_kernel)
MAX_LORA_RANK = 16
# (context, query tokens) per sequence, the table width (None: what they need), a slot per row.
STEPS: list[tuple[list[tuple[int, int]], int | None, list[int]]] = [
    ([(4, 1)], None, [0]),  # the adapters' loads ride on this one
    ([(40, 1)] * 3, None, [0, 1, -1]),  # three rows, two adapters and the base model
    ([(30, 1)] * 2, 16, [2, 2]),
    ([(0, 7)], None, [1]),  # prompts
    ([(0, 16), (0, 16)], None, [0, 2]),
    ([(32, 16)] + [(3, 1)] * (MAX_NUM_SEQS - 1), None, [i % 4 - 1 for i in range(MAX_NUM_SEQS)]),
    ([(0, 9), (100, 1), (17, 1)], 17, [2, -1, 1]),
    ([(20, 1)] * MAX_NUM_SEQS, None, [i % 3 for i in range(MAX_NUM_SEQS)]),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("warm-up-lora")
    # An MLP width that is no multiple of 16, and the up part's columns off 16-byte alignment
    # (90 floats in): the parts' launches specialise differently, several variants to compile.
    model = save_small_llama(
        root / "model",
        hidden_size=96,
        intermediate_size=90,
        num_attention_heads=6,
        max_position_embeddings=1024,
        vocab_size=300,
    )
    return {
        "model": model,
        "qv": make_peft_adapter(model, root / "qv", ("q_proj", "v_proj"), rank=8, seed=1),
        "mlp": make_peft_adapter(model, root / "mlp", ("o_proj", *MLP), rank=4, rslora=True, seed=2),
        "all": make_peft_adapter(model, root / "all", (*ATTENTION, *MLP), rank=MAX_LORA_RANK, seed=3),
    }


def _loads(files: dict[str, Path]) -> tuple[AdapterLoad, ...]:
    return tuple(AdapterLoad(slot, name, str(files[name]), 1) for slot, name in enumerate(("qv", "all", "mlp")))


def _runner(files: dict[str, Path], monkeypatch: pytest.MonkeyPatch, warm_up: bool) -> ModelRunner:
    monkeypatch.setattr(ModelRunner, "_warms_up", lambda self: warm_up)
    return ModelRunner(
        WorkerConfig(
            model=str(files["model"]),
            dtype="float32",
            device="cpu",
            attention_backend="triton",
            cache=CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks=NUM_BLOCKS, num_cpu_blocks=0),
            max_num_seqs=MAX_NUM_SEQS,
            lora=LoraConfig(max_loras=4, max_lora_rank=MAX_LORA_RANK),
        )
    )


@pytest.mark.skipif(not interpreting(), reason="runs the kernels on CPU tensors, in the interpreter")
def test_adapted_steps_after_the_warm_up_launch_no_kernel_variant_it_did_not(
    files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = KernelKeys(monkeypatch, KERNELS + LORA_KERNELS)
    monkeypatch.setattr(paged_attention, "_parallel_units", lambda device: 2 * 132)
    runner = _runner(files, monkeypatch, warm_up=True)
    warmed = recorder.take()
    for i, (seqs, width, slots) in enumerate(STEPS):
        plan = replace(step_plan(seqs, width), lora_slots=np.array(slots, np.int32))
        runner.execute(replace(plan, adapter_loads=_loads(files)) if i == 0 else plan)
    later = recorder.take()
    assert {k.fn.__name__ for k in LORA_KERNELS} <= set(later)  # the adapted steps did launch them
    new = {name: keys - warmed.get(name, set()) for name, keys in later.items()}
    assert all(not keys for keys in new.values()), "\n".join(f"{n}: {k}" for n, ks in new.items() for k in ks)


def _generate(runner: ModelRunner, files: dict[str, Path]) -> list[np.ndarray]:
    """Three prompts decoded greedily through two adapters and the base model: each step's
    tokens and log-probabilities."""
    prompts = [[5, 17, 42, 99, 3], list(range(10, 30)), [7, 7, 150, 3, 60, 61]]
    tables = [[3, 9], [4, 2], [0, 5]]
    context = [0, 0, 0]
    out = []
    for step in range(4):
        feeds = [Feed(i, prompts[i][context[i] :], context[i], tables[i], output_position=step) for i in range(3)]
        plan: StepPlan = replace(make_plan(step, feeds), lora_slots=np.array([0, 1, -1], np.int32))
        result = runner.execute(replace(plan, adapter_loads=_loads(files)) if step == 0 else plan)
        for i in range(3):
            context[i] = len(prompts[i])
            prompts[i].append(int(result.sampled_token_ids[i]))
        out += [result.sampled_token_ids, result.logprobs]
    return out


@pytest.mark.skipif(not interpreting(), reason="runs the kernels on CPU tensors, in the interpreter")
def test_the_lora_warm_up_leaves_the_slots_empty_and_every_result_as_without_it(
    files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    warmed = _runner(files, monkeypatch, warm_up=True)
    slots = warmed.lora
    assert slots is not None
    assert slots.loaded == [None] * 4 and slots.targets == [frozenset()] * 4 and slots.ranks == [0] * 4
    assert not slots.step.active and slots.step.token_slots is None  # the graphs capture no adapter
    assert not slots.scales.any() and all(not p.a.any() and not p.b.any() for _, p in slots.layers.values())
    # The slot the warm-up ran through holds no adapter: a row naming it without a load is refused.
    with pytest.raises(PlanError, match="slot 0 holds no adapter"):
        warmed.execute(replace(step_plan([(0, 3)], None), lora_slots=np.array([0], np.int32)))
    cold = _runner(files, monkeypatch, warm_up=False)
    for got, want in zip(_generate(warmed, files), _generate(cold, files), strict=True):
        assert np.array_equal(got, want)
    assert torch.equal(warmed.lora.scales, cold.lora.scales)  # type: ignore[union-attr]
