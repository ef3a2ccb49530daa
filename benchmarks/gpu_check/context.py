"""What every section is handed: where it runs, at which scale, and what earlier sections built."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

if TYPE_CHECKING:
    from gpu_check.runner import Budget

T = TypeVar("T")

MODES = ("full", "smoke", "dry")


class Skip(Exception):
    """Raised by a section that cannot run here (no CUDA, no model directory): recorded as
    skipped with this reason, which is not a failure."""


@dataclass
class Context:
    """`mode`: "full" measures at the sizes the targets are stated for (a GPU); "smoke" runs
    every measurement end to end at tiny sizes (any device, numbers meaningless); "dry" builds
    each section's inputs at tiny sizes and constructs what it can, measuring nothing."""

    device: torch.device
    mode: str
    iters: int
    model_dir: Path  # SmolLM2-135M-Instruct, for the parity section
    workdir: Path  # checkpoints the sections write, removed at the end of the run
    budget: Budget
    _built: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")

    @property
    def dry(self) -> bool:
        return self.mode == "dry"

    @property
    def tiny(self) -> bool:
        return self.mode != "full"

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def shared(self, key: str, build: Callable[[], T]) -> T:
        """`build()` once per run: a checkpoint the e2e section writes serves the memory
        section too, and one that failed to build is tried again by the next section."""
        if key not in self._built:
            self._built[key] = build()
        value: T = self._built[key]
        return value

    def release(self) -> None:
        """Between sections: what one section left on the device must not count against the
        next one's memory measurement."""
        import gc

        gc.collect()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
