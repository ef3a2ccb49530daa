"""llmserve's public Python package: the gRPC clients and the `llmserve` command.

Names load on first use, so `import llmserve` alone starts nothing and imports neither torch
nor grpc.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LlmserveClient": "llmserve.client",
    "AsyncLlmserveClient": "llmserve.client",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'llmserve' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
