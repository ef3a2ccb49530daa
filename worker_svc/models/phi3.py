"""Phi-3 and Phi-4 (`Phi3ForCausalLM`): Llama's layer, with q/k/v and gate/up already fused
in the checkpoint (their loaders split them, see ColumnParallelLinear), LongRoPE (short and
long frequencies, see worker_svc/layers/rotary.py), a partial rotary factor (Phi-4-mini rotates
three quarters of each head) and a sliding window on every layer where the config has one."""

from __future__ import annotations

from typing import Any

from worker_svc.models.decoder import DecoderLayer
from worker_svc.models.shape import ModelShape, base_shape, text_config

LAYER = DecoderLayer


def shape(config: Any, tp_size: int) -> ModelShape:
    return base_shape(config, tp_size, hidden_act=text_config(config).hidden_act, qkv_bias=False, o_bias=False)
