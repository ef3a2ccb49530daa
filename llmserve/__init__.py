"""llmserve's public Python package: the gRPC clients, the offline API and the `llmserve` command.

    from llmserve import LLM, SamplingParams          # offline batch generation, vLLM's shape
    from llmserve import StructuredOutputsParams      # ... constrained to a JSON schema, regex, ...
    from llmserve import LoRARequest                  # ... through a LoRA adapter
    from llmserve import LlmserveClient               # a client of a running service

Names load on first use, so `import llmserve` alone starts nothing and imports neither torch
nor grpc.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LlmserveClient": "llmserve.client",
    "AsyncLlmserveClient": "llmserve.client",
    "LLM": "llmserve.llm",
    "SamplingParams": "llmserve.sampling_params",
    "StructuredOutputsParams": "llmserve.sampling_params",
    "LoRARequest": "llmserve.lora_request",
    "RequestOutput": "llmserve.outputs",
    "CompletionOutput": "llmserve.outputs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'llmserve' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
