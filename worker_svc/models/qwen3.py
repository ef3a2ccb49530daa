"""Qwen3: Llama's layer with an RMSNorm over each query and key head before the rotation, a
head size of its own (not hidden / heads), sliding windows on the layers `layer_types` marks
when `use_sliding_window` is set.

Qwen3-MoE: the same attention; the feed-forward of layer i is the experts (worker_svc/layers/moe.py)
unless i is in `mlp_only_layers` or (i + 1) is not a multiple of `decoder_sparse_step`, where
it is a dense MLP of `intermediate_size`. The top-k weights are renormalised with
`norm_topk_prob`. No shared experts (Qwen2-MoE's) in this family."""

from __future__ import annotations

from typing import Any

from worker_svc.models.decoder import DecoderLayer
from worker_svc.models.shape import ModelShape, base_shape, text_config

LAYER = DecoderLayer


def shape(config: Any, tp_size: int) -> ModelShape:
    return base_shape(config, tp_size, qk_norm=True)


def moe_shape(config: Any, tp_size: int) -> ModelShape:
    text = text_config(config)
    dense = set(getattr(text, "mlp_only_layers", None) or ())
    step = getattr(text, "decoder_sparse_step", 1) or 1
    return base_shape(
        config,
        tp_size,
        qk_norm=True,
        num_experts=text.num_experts,
        experts_per_token=text.num_experts_per_tok,
        moe_intermediate_size=text.moe_intermediate_size,
        renormalize_top_k=bool(text.norm_topk_prob),
        sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(text.num_hidden_layers)),
    )
