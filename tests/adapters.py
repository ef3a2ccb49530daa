"""LoRA adapters for tests, made with peft over a model directory, and transformers + peft as
the reference for what a request through an adapter must generate."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from common.lora_format import ATTENTION_MODULES, MLP_MODULES

ATTENTION, MLP = ATTENTION_MODULES, MLP_MODULES


def save_small_llama(out: Path, **overrides: Any) -> Path:
    """A random-weight float32 Llama of 2 layers and hidden size 64 saved to `out` (no
    tokenizer): the base model the worker-side LoRA tests adapt. Seeded, so the same
    overrides give the same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    params: dict[str, Any] = dict(
        vocab_size=200,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.3,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**(params | overrides))).float().save_pretrained(str(out))
    return out


def make_peft_adapter(
    model_dir: Path,
    out: Path,
    targets: Sequence[str],
    rank: int = 8,
    alpha: float = 16.0,
    seed: int = 0,
    rslora: bool = False,
    std: float = 0.2,
) -> Path:
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) for
    `model_dir`, with random non-zero A and B (peft initialises B to zero: a no-op adapter
    would test nothing). `std` sizes the update so greedy tokens change without the output
    becoming noise."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, use_rslora=rslora)
    model = get_peft_model(base, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * std)
    model.save_pretrained(str(out))
    return out


def reference_greedy(
    model_dir: Path, adapter_dir: Path | None, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """transformers' (+ peft's, with an adapter) float32 greedy tokens for each prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs
