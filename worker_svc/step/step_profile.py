"""Where a step's time goes on the worker, by part (`--profile-steps`).

The parts (StepResult.part_seconds): "prepare" (plan checks, block operations, input
tensors), "embed", "linear" (every projection but the LM head, with the SiLU-and-mul the
gate_up GEMM runs on its sums where it does), "attention" (KV store and attention),
"norm_act" (RMSNorm, rotary, SiLU-and-mul on its own), "lm_head", "sampling" (logit
statistics, processing, sampling, log-probabilities) and "forward_other" (what the forward pass
spends outside those: residual adds, views, Python). The servicer adds "plan_decode" and the
previous step's "result_encode".

Timing hooks are attached only when profiling, so an unprofiled worker runs exactly the code
it always runs. On CUDA each boundary synchronizes the device, which costs throughput: profile
to find where time goes, not to measure speed.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from worker_svc.layers.replicated import RMSNorm, SiluAndMul
from worker_svc.layers.tp_layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)

# Parts measured inside the forward pass; whatever else it spends is "forward_other".
FORWARD_PARTS = ("embed", "linear", "attention", "norm_act")


class StepProfile:
    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self._sync: Callable[[], None] = (
            (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        )
        self.parts: dict[str, float] = defaultdict(float)
        self._attach(model)

    def _category(self, module: nn.Module) -> str | None:
        # ParallelLMHead before VocabParallelEmbedding: it is one.
        if isinstance(module, ParallelLMHead):
            return "lm_head"
        if isinstance(module, VocabParallelEmbedding):
            return "embed"
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            return "linear"
        if isinstance(module, (RMSNorm, SiluAndMul)):
            return "norm_act"
        return None

    def _attach(self, model: nn.Module) -> None:
        for module in model.modules():
            part = self._category(module)
            if part is not None:
                module.forward = self._timed(module.forward, part)
            if isinstance(module, MergedColumnParallelLinear):  # gate_up with the SiLU fused
                module.silu_and_mul = self._timed(module.silu_and_mul, "linear")  # type: ignore[method-assign]
        # Attention and rotary are called per layer but are not modules of their own.
        attention = getattr(model, "attention", None)
        if attention is not None:
            attention.forward = self._timed(attention.forward, "attention")
        rotary = getattr(model, "rotary", None)
        if rotary is not None:
            rotary.rotate = self._timed(rotary.rotate, "norm_act")

    def _timed(self, fn: Callable[..., Any], part: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._sync()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._sync()
                self.parts[part] += time.perf_counter() - start

        return timed

    @contextmanager
    def section(self, part: str) -> Iterator[None]:
        """Time a stretch of the runner's own code as `part`."""
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.parts[part] += time.perf_counter() - start

    def take(self) -> dict[str, float]:
        """This step's parts, resetting them. The runner times the whole forward pass as the
        section "forward"; what its measured parts leave of it is "forward_other"."""
        parts = dict(self.parts)
        self.parts.clear()
        forward = parts.pop("forward", 0.0)
        if forward:
            parts["forward_other"] = max(forward - sum(parts.get(p, 0.0) for p in FORWARD_PARTS), 0.0)
        return parts
