"""What a served LoRA adapter is, in PEFT's own terms: the scheduler checks an adapter against
it when it is registered (scheduler_svc/lora/adapter_registry.py, no torch) and each worker again when it
reads the tensors (worker_svc/lora/adapter_cache.py), so both refuse the same adapters."""

from __future__ import annotations

import math
import re

# What a slot can adapt: the projections of the attention and of the dense MLP.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
MODULES = ATTENTION_MODULES + MLP_MODULES

# PEFT's tensor names: base_model.model.model.layers.{layer}.{self_attn|mlp}.{module}.lora_{A|B}.weight
# (groups: layer, block, module, part).
TENSOR_NAME = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")

# adapter_config.json fields that change what the adapter computes, beyond B @ A x * scale on
# those projections: refused rather than served wrong (field -> what it is).
UNSUPPORTED = {
    "use_dora": "DoRA",
    "modules_to_save": "modules_to_save (fully trained copies of modules)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "fan_in_fan_out": "fan_in_fan_out weights",
    "trainable_token_indices": "trainable token embeddings",
    "lora_bias": "a trained bias on lora_B (lora_bias)",
    "target_parameters": "LoRA on raw parameters (target_parameters)",
    "layer_replication": "replicated layers (layer_replication)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QALoRA (use_qalora)",
}


def lora_scale(rank: int, alpha: float, rslora: bool) -> float:
    """The factor on B @ A x: alpha / rank, or alpha / sqrt(rank) for rank-stabilised LoRA."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank
