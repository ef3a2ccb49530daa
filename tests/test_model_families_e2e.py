"""Each model family end to end: greedy tokens streamed by a real worker process and a real
scheduler on real ports equal transformers' greedy `generate`, token for token.

Random-weight models with SmolLM2's tokenizer (tests/conftest.py's make_tiny_model), with
the family's features on and sliding windows shorter than the prompts, so that decode runs
long past the window. Models with head_dim 64 run through our C++ kernels on the CPU, the
others through the torch path (the worker's `auto` backend picks).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from tests.conftest import collect, make_tiny_model, request, start_scheduler, start_worker, stop_scheduler

PROMPT_LENGTHS = (20, 9, 31)
NEW_TOKENS = 16
FAMILIES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "mistral-sliding-window": (MistralConfig, MistralForCausalLM, dict(sliding_window=7)),
    "qwen3-sliding-window": (
        Qwen3Config,
        Qwen3ForCausalLM,
        dict(head_dim=32, use_sliding_window=True, sliding_window=7, max_window_layers=1),
    ),
    # Plain Qwen3: per-head q/k norms, head_dim 64 (not hidden / heads), no window; on the C++ path.
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=64, tie_word_embeddings=False)),
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(num_local_experts=8, num_experts_per_tok=2)),
    "qwen3-moe": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, mlp_only_layers=[0]),
    ),
    # Phi-3 LongRoPE: the short factors and the attention factor of 512 / 47. Every sequence
    # stays within the original length: past it, transformers' `generate` drops its cache and
    # rotates every position with the long factors, where we rotate only the positions past it
    # with them (docs/models.md, LongRoPE).
    "phi3-longrope": (
        Phi3Config,
        Phi3ForCausalLM,
        dict(
            pad_token_id=0,
            original_max_position_embeddings=max(PROMPT_LENGTHS) + NEW_TOKENS,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.3 * i for i in range(8)],  # head_dim 16
                "long_factor": [2.0 + 0.5 * i for i in range(8)],
            },
        ),
    ),
    "phi4-partial-rotary": (
        Phi3Config,
        Phi3ForCausalLM,
        dict(pad_token_id=0, partial_rotary_factor=0.75, sliding_window=7),
    ),
    "gemma2": (
        Gemma2Config,
        Gemma2ForCausalLM,
        dict(head_dim=64, query_pre_attn_scalar=48, sliding_window=7, attn_logit_softcapping=4.0),
    ),
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        dict(
            head_dim=64, query_pre_attn_scalar=48, sliding_window=7, layer_types=["sliding_attention", "full_attention"]
        ),
    ),
}


def reference_greedy(model_dir: Path, model_cls: Any, prompts: list[list[int]]) -> list[list[int]]:
    ref = model_cls.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None  # the service runs with ignore_eos
    out = []
    with torch.no_grad():
        for ids in prompts:
            generated = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0)
            out.append(generated[0, len(ids) :].tolist())
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
async def test_greedy_through_the_services_equals_transformers(tmp_path: Path, smollm2_dir: Path, family: str) -> None:
    config_cls, model_cls, extra = FAMILIES[family]
    model_dir = make_tiny_model(tmp_path / family, smollm2_dir, config_cls, model_cls, **extra)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    want = reference_greedy(model_dir, model_cls, prompts)
    worker = start_worker(model_dir, "--num-gpu-blocks", "64")
    try:
        scheduler = await start_scheduler(model_dir, worker.address)
        try:
            await scheduler.wait_ready()
            gens = await asyncio.gather(
                *(collect(scheduler.stub, request(ids=p, max_tokens=NEW_TOKENS, ignore_eos=True)) for p in prompts)
            )
            await scheduler.wait_idle()  # every block back in the free pool
        finally:
            await stop_scheduler(scheduler)
    finally:
        worker.stop()
    assert [gen.token_ids for gen in gens] == want
