"""Gemma 2 and Gemma 3 (text): the sandwich layer (norms after attention and MLP as well as
before), (1 + w) norms, embeddings times sqrt(hidden), GeGLU (gelu with the tanh
approximation), scores scaled by query_pre_attn_scalar ** -0.5, sliding-window layers
interleaved with global ones (`layer_types`).

Gemma 2 soft-caps the attention scores and the final logits (tanh). Gemma 3 has no caps by
default (it reads them all the same), norms each query and key head (as Qwen3, with Gemma's
(1 + w)) and gives sliding layers a rope base of their own (`rope_parameters` per layer type).
"""

from __future__ import annotations

from typing import Any

from worker_svc.models.decoder import SandwichDecoderLayer
from worker_svc.models.shape import ModelShape, base_shape, text_config

LAYER = SandwichDecoderLayer


def _common(text: Any) -> dict[str, Any]:
    if getattr(text, "use_bidirectional_attention", False):
        raise ValueError("Gemma with use_bidirectional_attention (an encoder) is not supported")
    return dict(
        hidden_act=text.hidden_activation,
        attn_scale=float(text.query_pre_attn_scalar) ** -0.5,
        norm_offset=1.0,
        embed_scale=float(text.hidden_size) ** 0.5,
        attn_softcap=float(getattr(text, "attn_logit_softcapping", None) or 0.0),
        final_softcap=float(getattr(text, "final_logit_softcapping", None) or 0.0),
    )


def gemma2_shape(config: Any, tp_size: int) -> ModelShape:
    return base_shape(config, tp_size, **_common(text_config(config)))


def gemma3_shape(config: Any, tp_size: int) -> ModelShape:
    text = text_config(config)
    return base_shape(config, tp_size, qk_norm=True, layer_rope=tuple(text.layer_types), **_common(text))
