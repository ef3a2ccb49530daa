"""LoRA adapters read from their PEFT directories into host memory, the most recent few kept.

A plan's AdapterLoad names a directory; refilling a device slot with an adapter read before
takes its host copy instead of the files (`LoraConfig.host_copies` of them, least recently used
dropped first). Copies are whole (unsharded) tensors: each tensor-parallel rank takes its part
when it fills its slot (worker_svc/lora/lora_slots.py).

The scheduler checked the files against the model already (scheduler_svc/lora/adapter_registry.py); the
checks here are what a worker must not get wrong on its own: rank, modules and shapes.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from common.lora_format import TENSOR_NAME, UNSUPPORTED, lora_scale
from common.plan import AdapterLoad


def _what(key: str) -> str:
    """Why a tensor of the file is not one a slot holds."""
    if ".experts." in key:
        return "adapts an expert of a mixture-of-experts layer, which no slot holds"
    for module in ("embed_tokens", "lm_head"):
        if f".{module}." in key:
            return f"adapts {module}, which no slot holds (only q/k/v/o_proj and gate/up/down_proj)"
    if "lora_magnitude_vector" in key:
        return "is a DoRA magnitude (DoRA is not supported)"
    return "is not a LoRA weight of a decoder layer's projection"


@dataclass(frozen=True)
class HostAdapter:
    name: str
    rank: int
    scale: float  # lora_alpha / r (rsLoRA: / sqrt(r))
    # (layer, module) -> (A [r, in], B [out, r]), on the host, whole.
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def modules(self) -> frozenset[str]:
        return frozenset(m for _, m in self.weights)


def read_adapter(path: str, name: str, max_rank: int) -> HostAdapter:
    """A PEFT LoRA directory; ValueError naming the adapter and what is wrong."""
    directory = Path(path)
    try:
        config = json.loads((directory / "adapter_config.json").read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"adapter {name!r}: no readable adapter_config.json in {path}: {error}") from error
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {name!r}: only LoRA adapters are served (peft_type LORA)")
    rank = int(config.get("r", 0))
    if not 1 <= rank <= max_rank:
        raise ValueError(f"adapter {name!r}: rank {rank} outside [1, {max_rank}] (--max-lora-rank)")
    for key in UNSUPPORTED:
        if config.get(key):
            raise ValueError(f"adapter {name!r}: {key} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"adapter {name!r}: trained biases are not supported")
    alpha = float(config.get("lora_alpha", rank))
    scale = lora_scale(rank, alpha, bool(config.get("use_rslora")))
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(directory / "adapter_model.safetensors"), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                match = TENSOR_NAME.match(key)
                if match is None:
                    raise ValueError(f"adapter {name!r}: tensor {key} {_what(key)}")
                layer, module, part = int(match.group(1)), match.group(3), match.group(4)
                parts.setdefault((layer, module), {})[part] = f.get_tensor(key)
    except OSError as error:
        raise ValueError(f"adapter {name!r}: cannot read {path}/adapter_model.safetensors: {error}") from error
    weights = {}
    for (layer, module), ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"adapter {name!r}: layer {layer} {module} lacks lora_A or lora_B")
        a, b = ab["A"], ab["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"adapter {name!r}: layer {layer} {module} has A {tuple(a.shape)}, B {tuple(b.shape)}")
        weights[(layer, module)] = (a, b)
    if not weights:
        raise ValueError(f"adapter {name!r}: no LoRA tensors in {path}")
    return HostAdapter(name, rank, scale, weights)


class AdapterCache:
    def __init__(self, capacity: int, max_rank: int) -> None:
        self.capacity = capacity
        self.max_rank = max_rank
        self._copies: OrderedDict[tuple[str, int, str], HostAdapter] = OrderedDict()
        self.reads = 0  # directories read (misses)
        self.hits = 0

    def get(self, load: AdapterLoad) -> HostAdapter:
        key = (load.name, load.version, load.path)
        copy = self._copies.get(key)
        if copy is not None:
            self._copies.move_to_end(key)
            self.hits += 1
            return copy
        copy = read_adapter(load.path, load.name, self.max_rank)
        self.reads += 1
        self._copies[key] = copy
        while len(self._copies) > self.capacity:
            self._copies.popitem(last=False)
        return copy
