"""Llama 2 and 3 (every rope scaling transformers knows but dynamic NTK), Mistral (with its
sliding window), Qwen2 (biases on q, k and v; sliding windows on the layers `layer_types`
marks), SmolLM2: the plain pre-norm decoder."""

from __future__ import annotations

from typing import Any

from worker_svc.models.decoder import DecoderLayer
from worker_svc.models.shape import ModelShape, architecture, base_shape, text_config

LAYER = DecoderLayer


def shape(config: Any, tp_size: int) -> ModelShape:
    text = text_config(config)
    arch = architecture(config)
    if arch == "Qwen2ForCausalLM":
        # Qwen2 has biases on q, k, v only; Llama's attention_bias covers o_proj as well.
        return base_shape(config, tp_size, qkv_bias=True, o_bias=False)
    features: dict[str, Any] = {"hidden_act": getattr(text, "hidden_act", "silu")}
    if arch == "LlamaForCausalLM":
        features["layer_windows"] = ()  # transformers' Llama never reads a `sliding_window` key
    return base_shape(config, tp_size, **features)
