"""Qwen3 (dense): Llama's layer with an RMSNorm over each query and key head before the
rotation, a head size of its own (not hidden / heads), sliding windows on the layers
`layer_types` marks when `use_sliding_window` is set."""

from __future__ import annotations

from typing import Any

from worker_svc.models.decoder import DecoderLayer
from worker_svc.models.shape import ModelShape, base_shape

LAYER = DecoderLayer


def shape(config: Any, tp_size: int) -> ModelShape:
    return base_shape(config, tp_size, qk_norm=True)
