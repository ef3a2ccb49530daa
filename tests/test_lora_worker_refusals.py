"""What a worker refuses of an adapter, and that a refused plan changes nothing.

An adapter is read and checked against the model (modules, layers, shapes, rank, what its config
turns on) before the runner applies the plan's block operations: a bad one refuses the whole plan
(PlanError naming the adapter and the problem) with the KV cache, the slots and the other loads
of the plan untouched.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from common.config import CacheConfig, LoraConfig, WorkerConfig
from common.plan import AdapterLoad, StepPlan
from tests.adapters import make_peft_adapter, save_small_llama
from tests.plans import Feed, make_plan
from worker_svc.step.runner import ModelRunner, PlanError

PROMPT = [5, 17, 42, 99, 3]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-refusals")
    model = save_small_llama(root / "model", initializer_range=0.02)
    good = make_peft_adapter(model, root / "good", ("q_proj", "v_proj"), rank=8, seed=1)
    out = {"model": model, "good": good}
    out["embed"] = make_peft_adapter(model, root / "embed", ("embed_tokens", "lm_head"), rank=4, seed=2)
    tensors = load_file(str(good / "adapter_model.safetensors"))
    q = "base_model.model.model.layers.0.self_attn.q_proj"

    def variant(name: str, config: dict[str, object], change: dict[str, torch.Tensor | None]) -> None:
        path = root / name
        path.mkdir()
        base = json.loads((good / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps(base | config))
        new = {k: v for k, v in (tensors | change).items() if v is not None}
        save_file(new, str(path / "adapter_model.safetensors"))
        out[name] = path

    variant("rank", {"r": 32}, {})
    variant("dora", {"use_dora": True}, {})
    variant("alora", {"alora_invocation_tokens": [5, 6]}, {})
    variant("bias", {"bias": "lora_only"}, {})
    variant("expert", {}, {"base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_A.weight": torch.zeros(8, 64)})
    far = q.replace("layers.0", "layers.5")  # the model has 2 layers
    variant("layer", {}, {f"{far}.lora_A.weight": torch.zeros(8, 64), f"{far}.lora_B.weight": torch.zeros(64, 8)})
    variant("shape", {}, {f"{q}.lora_B.weight": torch.zeros(32, 8)})  # q_proj has 64 outputs
    variant("lone", {}, {f"{q}.lora_B.weight": None})
    return out


def runner(files: dict[str, Path]) -> ModelRunner:
    return ModelRunner(
        WorkerConfig(
            model=str(files["model"]),
            dtype="float32",
            device="cpu",
            attention_backend="torch",
            cache=CacheConfig(block_size=8, num_gpu_blocks=16, num_cpu_blocks=4),
            lora=LoraConfig(max_loras=2, max_lora_rank=16),
        )
    )


def with_lora(plan: StepPlan, slots: list[int], loads: tuple[AdapterLoad, ...] = ()) -> StepPlan:
    return dataclasses.replace(plan, lora_slots=np.array(slots, np.int32), adapter_loads=loads)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("rank", "adapter 'rank': rank 32 outside"),
        ("dora", "adapter 'dora': use_dora is not supported"),
        ("alora", "adapter 'alora': alora_invocation_tokens is not supported"),
        ("bias", "adapter 'bias': trained biases"),
        ("embed", "adapter 'embed': tensor .* adapts (embed_tokens|lm_head)"),
        ("expert", "adapter 'expert': tensor .* expert of a mixture-of-experts layer"),
        ("layer", "adapter 'layer': layer 5 has no q_proj"),
        ("shape", r"adapter 'shape': layer 0 q_proj has A \(8, 64\) and B \(32, 8\)"),
        ("lone", "adapter 'lone': layer 0 q_proj lacks lora_A or lora_B"),
        ("missing", "adapter 'missing': no readable adapter_config.json"),
    ],
)
def test_bad_adapters_are_refused_by_name(files: dict[str, Path], name: str, message: str) -> None:
    r = runner(files)
    path = str(files.get(name, files["model"] / "nowhere"))
    with pytest.raises(PlanError, match=message):
        r.execute(with_lora(make_plan(0, [Feed(0, PROMPT, 0, [1])]), [0], (AdapterLoad(0, name, path, 1),)))


def test_a_refused_load_leaves_cache_slots_and_other_loads_untouched(files: dict[str, Path]) -> None:
    r = runner(files)
    assert r.lora is not None
    r.execute(make_plan(0, [Feed(0, PROMPT, 0, [1])]))  # block 1 holds KV now
    before = [t.clone() for layer in r.kv.layers for t in layer]
    good, bad = AdapterLoad(0, "good", str(files["good"]), 1), AdapterLoad(1, "dora", str(files["dora"]), 1)
    plan = dataclasses.replace(make_plan(1, [Feed(1, [7], 0, [3])]), copy=np.array([[1, 2]], np.int32))
    with pytest.raises(PlanError, match="use_dora"):
        r.execute(with_lora(plan, [0], (good, bad)))
    assert all(torch.equal(a, b) for a, b in zip(before, (t for layer in r.kv.layers for t in layer)))
    assert r.lora.loaded == [None, None]  # the good load of the refused plan was not applied either
    with pytest.raises(PlanError, match="slot 0 holds no adapter"):
        r.execute(with_lora(make_plan(2, [Feed(1, [7], 0, [3])]), [0]))
    # The good adapter's host copy was kept: loading it for real reads no file.
    reads = r.lora.cache.reads
    r.execute(with_lora(make_plan(3, [Feed(1, [7], 0, [3])]), [0], (good,)))
    assert (r.lora.cache.reads, r.lora.loaded[0]) == (reads, ("good", 1))


@pytest.mark.parametrize(
    ("slots", "loads", "message"),
    [
        ([2], (), "lora_slots: slot 2 outside"),
        ([-1], ((2, "good"),), "adapter_loads: slot 2 outside"),
        ([1], ((0, "good"),), "slot 1 holds no adapter"),
    ],
)
def test_slots_outside_or_empty_are_refused_before_the_cache_is_touched(
    files: dict[str, Path], slots: list[int], loads: tuple[tuple[int, str], ...], message: str
) -> None:
    r = runner(files)
    assert r.lora is not None
    plan = with_lora(
        make_plan(0, [Feed(0, PROMPT, 0, [1])]), slots, tuple(AdapterLoad(s, n, str(files[n]), 1) for s, n in loads)
    )
    with pytest.raises(PlanError, match=message):
        r.execute(plan)
    assert r.lora.cache.reads == 0  # refused by the checks, before any file was read
