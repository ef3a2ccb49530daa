"""Which implementation runs a checkpoint: config.json's `architectures` names the family.

Each family module turns a config into a `ModelShape` (refusing what it cannot run, with the
reason) and names its decoder layer; the rest is shared (worker_svc/models/decoder.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from worker_svc.device.parallel import SINGLE, ParallelGroup
from worker_svc.device.pipeline import PipelineStage
from worker_svc.models import gemma, llama, mixtral, phi3, qwen3
from worker_svc.models.decoder import CausalLM, DecoderLayer
from worker_svc.models.shape import ModelShape, architecture


@dataclass(frozen=True)
class Family:
    shape: Callable[[Any, int], ModelShape]  # (config, tp size) -> this rank's shape
    layer: type[DecoderLayer]
    renames: tuple[tuple[str, str], ...] = ()  # checkpoint name fragment -> ours


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(llama.shape, llama.LAYER),
    "MistralForCausalLM": Family(llama.shape, llama.LAYER),
    "Qwen2ForCausalLM": Family(llama.shape, llama.LAYER),
    "Qwen3ForCausalLM": Family(qwen3.shape, qwen3.LAYER),
    "Qwen3MoeForCausalLM": Family(qwen3.moe_shape, qwen3.LAYER),
    "MixtralForCausalLM": Family(mixtral.shape, mixtral.LAYER, mixtral.RENAMES),
    "Phi3ForCausalLM": Family(phi3.shape, phi3.LAYER),
    "Gemma2ForCausalLM": Family(gemma.gemma2_shape, gemma.LAYER),
    "Gemma3ForCausalLM": Family(gemma.gemma3_shape, gemma.LAYER),
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)


def family_of(config: Any) -> Family:
    """The family of `config`'s first architecture (a config without one is read as Llama)."""
    arch = architecture(config)
    family = FAMILIES.get(arch)
    if family is None:
        raise ValueError(f"architecture {arch} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return family


def model_shape(config: Any, tp_size: int = 1) -> ModelShape:
    """The shape one rank of a group of `tp_size` sees; refuses a size the model cannot split."""
    return family_of(config).shape(config, tp_size)


def build_model(
    config: Any,
    dtype: torch.dtype,
    max_positions: int | None = None,
    attention_backend: str = "torch",
    group: ParallelGroup = SINGLE,
    stage: PipelineStage | None = None,
) -> CausalLM:
    """This rank's model for `config` (of its pipeline stage, when it is one), with
    uninitialised weights (see CausalLM.load_weights)."""
    family = family_of(config)
    shape = family.shape(config, group.world_size)
    return CausalLM(config, shape, family.layer, dtype, max_positions, attention_backend, group, family.renames, stage)
