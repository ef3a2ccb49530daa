"""Layers of the decoder, each owning how its weights are loaded (`weight_loader`).

The loader walks the checkpoint and hands every tensor to the parameter it belongs to,
with a shard id where several checkpoint tensors fill one parameter:

    qkv_proj.weight   rows [ q (num_heads*head_dim) | k (kv_heads*head_dim) | v (kv_heads*head_dim) ]
    gate_up_proj.weight rows [ gate (intermediate) | up (intermediate) ]

Fusing them turns three (or two) matmuls into one, which matters most for small batches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kernels.activation import silu_and_mul
from kernels.rms_norm import rms_norm

WeightLoader = Callable[[torch.Tensor, "str | None"], None]


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{name}: checkpoint tensor has shape {tuple(src.shape)}, the model wants {tuple(dst.shape)}")
    dst.copy_(src)


def _plain_loader(param: nn.Parameter) -> WeightLoader:
    def load(tensor: torch.Tensor, shard: str | None = None) -> None:
        _copy_checked(param.data, tensor, "weight")

    return load


class Linear(nn.Module):
    """y = x W^T (+ b); `shards` names row ranges filled from separate checkpoint tensors."""

    def __init__(self, in_features: int, shards: dict[str, int] | int, bias: bool = False) -> None:
        super().__init__()
        self.shards = shards if isinstance(shards, dict) else {"": shards}
        out_features = sum(self.shards.values())
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self._loader(param)  # type: ignore[attr-defined]
                param.shard_ids = tuple(self.shards)  # type: ignore[attr-defined]

    def _loader(self, param: nn.Parameter) -> WeightLoader:
        def load(tensor: torch.Tensor, shard: str | None = None) -> None:
            key = shard or ""
            if key not in self.shards:
                raise ValueError(f"unknown shard {shard!r}, this layer has {sorted(self.shards)}")
            start = 0
            for name, size in self.shards.items():
                if name == key:
                    break
                start += size
            _copy_checked(param.data[start : start + self.shards[key]], tensor, f"shard {key or 'weight'}")

        return load

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


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
        self.weight.weight_loader = _plain_loader(self.weight)  # type: ignore[attr-defined]

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


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = _plain_loader(self.weight)  # type: ignore[attr-defined]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
