"""Mixtral: Llama's attention (with a sliding window where the config has one) and a
mixture-of-experts feed-forward on every layer (worker_svc/layers/moe.py): top-k of
`num_local_experts`, the chosen weights always renormalised. The checkpoint keeps the block
as `block_sparse_moe` with experts' w1 (gate), w3 (up) and w2 (down)."""

from __future__ import annotations

from typing import Any

from worker_svc.models.decoder import DecoderLayer
from worker_svc.models.shape import ModelShape, base_shape, text_config

LAYER = DecoderLayer
RENAMES = ((".block_sparse_moe.", ".mlp."),)


def shape(config: Any, tp_size: int) -> ModelShape:
    text = text_config(config)
    return base_shape(
        config,
        tp_size,
        hidden_act=text.hidden_act,
        num_experts=text.num_local_experts,
        experts_per_token=text.num_experts_per_tok,
        moe_intermediate_size=text.intermediate_size,
        renormalize_top_k=True,
    )
