"""The decoder's replicated layers (every rank holds all of them) and the loading helpers the
tensor-parallel layers of worker_svc/tp_layers.py share.

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

# A torch.Tensor or a safetensors PySafeSlice: both take `[a:b]` and `[:, a:b]`.
Loaded = Any


def loaded_shape(loaded: Loaded) -> tuple[int, ...]:
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{name}: checkpoint tensor has shape {tuple(src.shape)}, the model wants {tuple(dst.shape)}")
    dst.copy_(src.to(dst.dtype))


def load_replicated(param: nn.Parameter, loaded: Loaded, shard_id: str | None = None) -> None:
    """The whole tensor, on every rank (norms, row-parallel biases)."""
    if loaded_shape(loaded) != tuple(param.shape):
        raise ValueError(f"weight: checkpoint tensor has shape {loaded_shape(loaded)}, the model wants {tuple(param.shape)}")
    copy_checked(param.data, loaded[:], "weight")


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 like the reference; with `residual`, adds it first.

    `forward(x, residual)` returns (normed, x + residual): the sum is the next layer's residual,
    so the add and the norm read x once. `fused` runs the Triton kernel, same interface.
    """

    def __init__(self, hidden_size: int, eps: float, fused: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.fused = fused
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = load_replicated  # type: ignore[attr-defined]

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused:
            return rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
        return self._norm(x), x


class SiluAndMul(nn.Module):
    """[..., 2 * d] -> [..., d]: silu(gate) * up (`fused`: one Triton kernel)."""

    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
