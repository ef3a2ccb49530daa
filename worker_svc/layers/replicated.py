"""The decoder's replicated layers (every rank holds all of them) and the loading helpers the
tensor-parallel layers of worker_svc/layers/tp_layers.py share.

Every parameter is made in the model's dtype (`dtype`; None: torch's default) on the ambient
device, never made in float32 and cast after: that would peak at 4 bytes a parameter, twice a
bfloat16 model's weights.

A `weight_loader(param, loaded, shard_id)` receives what the checkpoint holds for `param`:
a torch tensor, or a lazy safetensors slice that reads from disk only what is indexed
(`loaded[a:b]`, `loaded[:, a:b]`). Layers index the part their rank keeps, never the whole
weight unless the whole weight is theirs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels.activation import silu_and_mul
from kernels.rms_norm import rms_norm

# Which kernels a layer runs: "torch" (the reference), "triton" (our GPU kernels) or "cpu"
# (our C++ kernels, kernels/cpu_ops.py).
KERNELS = ("torch", "triton", "cpu")

# A torch.Tensor or a safetensors PySafeSlice: both take `[a:b]` and `[:, a:b]`.
Loaded = Any


def loaded_shape(loaded: Loaded) -> tuple[int, ...]:
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


class RowWindow:
    """Rows [start, start + rows) of a checkpoint tensor (a tensor or a lazy slice), indexed
    like one: how one part of a fused checkpoint tensor (Phi-3's qkv_proj) reaches the loader
    of that part, still reading from disk only what is indexed."""

    def __init__(self, loaded: Loaded, start: int, rows: int) -> None:
        self.loaded, self.start, self.rows = loaded, start, rows

    def get_shape(self) -> list[int]:
        return [self.rows, *loaded_shape(self.loaded)[1:]]

    def __getitem__(self, index: Any) -> torch.Tensor:
        rows, *rest = index if isinstance(index, tuple) else (index,)
        a, b, step = rows.indices(self.rows)
        if step != 1:
            raise ValueError("a row window is read in contiguous row ranges")
        return self.loaded[(slice(self.start + a, self.start + b), *rest)]


def copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{name}: checkpoint tensor has shape {tuple(src.shape)}, the model wants {tuple(dst.shape)}")
    dst.copy_(src.to(dst.dtype))


def load_replicated(param: nn.Parameter, loaded: Loaded, shard_id: str | None = None) -> None:
    """The whole tensor, on every rank (norms, row-parallel biases)."""
    if loaded_shape(loaded) != tuple(param.shape):
        raise ValueError(
            f"weight: checkpoint tensor has shape {loaded_shape(loaded)}, the model wants {tuple(param.shape)}"
        )
    copy_checked(param.data, loaded[:], "weight")


def cpu_kernels_for(kernels: str) -> Any:
    """The process's C++ kernels when `kernels` is "cpu" (built on first use), else None."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
    if kernels != "cpu":
        return None
    from kernels.cpu_ops import cpu_kernels

    return cpu_kernels()


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 like the reference; with `residual`, adds it first.

    `forward(x, residual)` returns (normed, x + residual): the sum is the next layer's residual,
    so the add and the norm read x once. `kernels` "triton" or "cpu" runs our kernel, same
    interface (the CPU one writes the sum into `residual` itself).

    With `offset` (Gemma: the checkpoint stores w and the norm applies 1 + w) the norm follows
    Gemma's own order: (1 + w) in float32 times the float32 normalised x, rounded once. Our
    kernels multiply Llama's way (round, then times w), so such a norm runs in torch.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        kernels: str = "torch",
        dtype: torch.dtype | None = None,
        offset: float = 0.0,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.offset = offset
        self._cpu = cpu_kernels_for(kernels)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = load_replicated  # type: ignore[attr-defined]

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x32 * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * x32.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.offset:  # Gemma's rounding order has no kernel (see the class docstring)
            if self._cpu is not None:
                return self._cpu.rms_norm(x, self.weight, self.eps, residual)
            if self.kernels == "triton":
                return rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
        return self._norm(x), x


class GeluAndMul(nn.Module):
    """[..., 2 * d] -> [..., d]: gelu(gate) (tanh approximation) * up, Gemma's feed-forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class SiluAndMul(nn.Module):
    """[..., 2 * d] -> [..., d]: silu(gate) * up (`kernels` "triton" or "cpu": one kernel)."""

    def __init__(self, kernels: str = "torch") -> None:
        super().__init__()
        self.kernels = kernels
        self._cpu = cpu_kernels_for(kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._cpu is not None:
            return self._cpu.silu_and_mul(x)
        if self.kernels == "triton":
            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
