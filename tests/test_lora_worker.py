"""LoRA on the worker: adapters in slots, mixed with the base model in the same steps, against
transformers + peft (float32, greedy), on the torch path, the C++ kernels' path and the Triton
path (the interpreter on a CPU); slot refills, the host copies, and the refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from common.config import CacheConfig, LoraConfig, WorkerConfig
from common.plan import AdapterLoad, StepPlan
from tests.adapters import ATTENTION, MLP, make_peft_adapter, reference_greedy, save_small_llama
from tests.conftest import KERNEL_DEVICE
from tests.plans import Feed, make_plan
from worker_svc.step.runner import ModelRunner, PlanError

NEW_TOKENS = 6
PROMPTS = [[5, 17, 42, 99, 3], list(range(10, 30)), [7, 7, 150, 3, 60, 61, 62, 9, 1]]
TABLES = [[3, 9, 1, 12], [4, 2, 15, 6, 11], [0, 5, 7, 8]]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A small Llama (heads of 64, so the C++ attention kernel takes it) and three adapters."""
    root = tmp_path_factory.mktemp("lora-worker")
    model = save_small_llama(root / "model", num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    return {
        "model": model,
        "qv": make_peft_adapter(model, root / "qv", ("q_proj", "v_proj"), rank=8, seed=1),
        "mlp": make_peft_adapter(model, root / "mlp", ("o_proj", *MLP), rank=4, rslora=True, seed=2),
        "all": make_peft_adapter(model, root / "all", (*ATTENTION, *MLP), rank=16, seed=3),
        "big": make_peft_adapter(model, root / "big", ("q_proj",), rank=32, seed=4),
    }


@pytest.fixture(scope="module")
def expected(files: dict[str, Path]) -> dict[str, list[list[int]]]:
    out = {
        name: reference_greedy(files["model"], files.get(name), PROMPTS, NEW_TOKENS) for name in ("qv", "mlp", "all")
    }
    out["base"] = reference_greedy(files["model"], None, PROMPTS, NEW_TOKENS)
    for name in ("qv", "mlp", "all"):
        assert out[name] != out["base"], f"adapter {name} changes nothing: the test could not fail"
    return out


def runner(files: dict[str, Path], backend: str, max_loras: int = 2, host_copies: int | None = None) -> ModelRunner:
    return ModelRunner(
        WorkerConfig(
            model=str(files["model"]),
            dtype="float32",
            device=KERNEL_DEVICE if backend == "triton" else "cpu",
            attention_backend=backend,
            cache=CacheConfig(block_size=8, num_gpu_blocks=16),
            lora=LoraConfig(max_loras=max_loras, max_lora_rank=16, max_cpu_loras=host_copies),
        )
    )


def with_lora(plan: StepPlan, slots: list[int], loads: tuple[AdapterLoad, ...] = ()) -> StepPlan:
    from dataclasses import replace

    return replace(plan, lora_slots=np.array(slots, np.int32), adapter_loads=loads)


def greedy(r: ModelRunner, slots: list[int], loads: tuple[AdapterLoad, ...], step0: int = 0) -> list[list[int]]:
    """Each prompt decoded NEW_TOKENS greedy steps through its slot, all rows in every step."""
    n = len(PROMPTS)
    tokens = [list(p) for p in PROMPTS]
    context = [0] * n
    outputs: list[list[int]] = [[] for _ in range(n)]
    for step in range(NEW_TOKENS):
        feeds = [Feed(i, tokens[i][context[i] :], context[i], TABLES[i], output_position=step) for i in range(n)]
        result = r.execute(with_lora(make_plan(step0 + step, feeds), slots, loads if step == 0 else ()))
        for i in range(n):
            context[i] = len(tokens[i])
            tokens[i].append(int(result.sampled_token_ids[i]))
            outputs[i].append(int(result.sampled_token_ids[i]))
    return outputs


def load(files: dict[str, Path], slot: int, name: str, version: int = 1) -> AdapterLoad:
    return AdapterLoad(slot, name, str(files[name]), version)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_mixed_adapters_in_one_step_equal_transformers_and_peft(
    files: dict[str, Path], expected: dict[str, list[list[int]]], backend: str
) -> None:
    r = runner(files, backend)
    assert r.attention_backend == backend
    assert (r.info("m").max_loras, r.info("m").max_lora_rank) == (2, 16)
    got = greedy(r, [-1, 0, 1], (load(files, 0, "qv"), load(files, 1, "mlp")))
    assert got == [expected["base"][0], expected["qv"][1], expected["mlp"][2]]
    # The slots keep their adapters: later plans only name them.
    assert greedy(r, [1, -1, 0], (), step0=100) == [expected["mlp"][0], expected["base"][1], expected["qv"][2]]


def test_a_refilled_slot_runs_its_new_adapter_and_host_copies_are_reused(
    files: dict[str, Path], expected: dict[str, list[list[int]]]
) -> None:
    r = runner(files, "torch", max_loras=1, host_copies=2)
    assert greedy(r, [0, 0, 0], (load(files, 0, "qv"),)) == expected["qv"]
    assert greedy(r, [0, -1, 0], (load(files, 0, "all"),), step0=10) == [
        expected["all"][0],
        expected["base"][1],
        expected["all"][2],
    ]
    assert r.lora is not None and r.lora.cache.reads == 2
    # Back to the first adapter: read from the host copy, not the files.
    assert greedy(r, [0, 0, -1], (load(files, 0, "qv"),), step0=20) == [
        expected["qv"][0],
        expected["qv"][1],
        expected["base"][2],
    ]
    assert (r.lora.cache.reads, r.lora.cache.hits) == (2, 1)


def test_bad_adapters_and_slots_are_refused(files: dict[str, Path], tmp_path: Path) -> None:
    r = runner(files, "torch")
    plan = make_plan(0, [Feed(0, PROMPTS[0], 0, TABLES[0])])
    with pytest.raises(PlanError, match="rank 32"):
        r.execute(with_lora(plan, [0], (load(files, 0, "big"),)))
    with pytest.raises(PlanError, match="slot 1 holds no adapter"):
        r.execute(with_lora(plan, [1]))
    with pytest.raises(PlanError, match="outside"):
        r.execute(with_lora(plan, [2], (load(files, 0, "qv"),)))
    dora = tmp_path / "dora"
    dora.mkdir()
    config = (files["qv"] / "adapter_config.json").read_text().replace('"use_dora": false', '"use_dora": true')
    (dora / "adapter_config.json").write_text(config)
    (dora / "adapter_model.safetensors").write_bytes((files["qv"] / "adapter_model.safetensors").read_bytes())
    with pytest.raises(PlanError, match="use_dora"):
        r.execute(with_lora(plan, [0], (AdapterLoad(0, "dora", str(dora), 1),)))
    plain = ModelRunner(
        WorkerConfig(
            model=str(files["model"]),
            dtype="float32",
            device="cpu",
            attention_backend="torch",
            cache=CacheConfig(block_size=8, num_gpu_blocks=16),
        )
    )
    assert plain.info("m").max_loras == 0
    with pytest.raises(PlanError, match="--enable-lora"):
        plain.execute(with_lora(plan, [0], (load(files, 0, "qv"),)))
