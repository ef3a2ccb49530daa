"""`--pp-layer-split auto`: the split from measured stages, and a pipeline started with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, LlamaForCausalLM

from tests.test_model_families_e2e import reference_greedy
from tests.test_pipeline import prompts_for, served
from worker_svc.device.stage_probe import StageProbe, auto_split, layer_bytes, measure, step_times

GIB = 1 << 30


def test_a_stage_twice_as_slow_gets_half_the_layers_and_the_step_times_end_within_20_percent() -> None:
    stages = [StageProbe(1e-3, 0.0, 64 * GIB), StageProbe(2e-3, 0.0, 64 * GIB)]
    counts = auto_split(stages, 30, 1 << 20)
    assert counts == (20, 10)
    times = step_times(stages, counts)
    assert max(times) / min(times) <= 1.2
    even = step_times(stages, (15, 15))
    assert max(even) / min(even) == pytest.approx(2.0)  # what an even split would leave


def test_the_last_stage_gets_fewer_layers_for_the_head_it_also_runs() -> None:
    stages = [StageProbe(1e-3, 0.0, 64 * GIB)] * 2 + [StageProbe(1e-3, 6e-3, 64 * GIB)]
    counts = auto_split(stages, 30, 1 << 20)
    assert sum(counts) == 30 and counts[2] < counts[0]
    times = step_times(stages, counts)
    assert max(times) - min(times) <= 1e-3 + 1e-12  # within one layer


def test_a_stage_short_of_memory_takes_what_it_holds_and_the_others_the_rest() -> None:
    per_layer = 100 << 20
    stages = [StageProbe(1e-3, 0.0, 64 * GIB), StageProbe(1e-3, 0.0, int(5 * per_layer / 0.9) + 1)]
    assert auto_split(stages, 30, per_layer) == (25, 5)
    with pytest.raises(ValueError, match="too few of 30 layers"):
        auto_split([StageProbe(1e-3, 0.0, per_layer)] * 2, 30, per_layer)


def test_a_probe_times_the_layer_and_only_the_last_stage_the_head(smollm2_dir: Path) -> None:
    config = AutoConfig.from_pretrained(smollm2_dir)
    first = measure(config, 1, torch.float32, torch.device("cpu"), last=False)
    last = measure(config, 1, torch.float32, torch.device("cpu"), last=True)
    assert first.layer_s > 0 and first.head_s == 0 and last.head_s > 0 and first.free_bytes > 0
    # SmolLM2-135M: 30 layers of about 3.5M parameters (q, k, v, o and the three MLP products).
    assert layer_bytes(config, 1, torch.float32) == 4 * (576 * 960 + 576 * 576 + 576 * 3072 + 1536 * 576)


async def test_a_pipeline_split_by_measurement_serves_greedy_equal_to_transformers(smollm2_dir: Path) -> None:
    prompts = prompts_for(11)
    want = reference_greedy(smollm2_dir, LlamaForCausalLM, prompts)
    assert await served(smollm2_dir, 2, 1, prompts, "--pp-layer-split", "auto") == want
