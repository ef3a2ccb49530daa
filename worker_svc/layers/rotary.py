"""Rotary position embedding (neox style: the two halves of each head rotate together).

With a partial rotary factor (Phi-4-mini: 0.75) only the first `rotary_dim` of each head's
dimensions rotate, the rest pass through; our fused kernels rotate whole heads, so such a
model rotates in torch whatever the kernels.

LongRoPE (Phi-3, Phi-4) has two sets of frequencies, for positions inside and past the
pretraining length. transformers picks one set per forward call from the longest position
in it; a step here mixes sequences of every length, so the table uses the short set below
`original_max_position_embeddings` and the long set from there on (what vLLM does). The two
agree with transformers for sequences that stay below that length, and for positions past
it once a sequence has passed it; a prompt that crosses it in one forward gets short-set
rotations for its first positions where transformers would use the long set throughout.
(transformers' `generate` even drops its cache on crossing and rotates every position again
with the long set; the KV cache here keeps what it holds, as vLLM's does.)

cos/sin are computed once for every position in float32, scaled by the rope type's attention
factor, and cast to the model dtype, exactly as the reference computes them per forward.
The rope types (linear, llama3, yarn, longrope, ...) come from transformers' own table, so
the frequencies match the reference by construction.

The tables are computed on the CPU whatever device the model is built under (the loader
builds it under `torch.device(cuda)`, a test under meta), and only the finished tables move
there, in the model dtype: the values do not depend on the device, a meta build needs no
arithmetic on meta tensors, and the device never holds a float32 copy.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kernels.rotary import apply_rotary
from worker_svc.layers.replicated import cpu_kernels_for


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The rope parameters of the config, or of one kind of layer where the config keeps a set
    per kind (Gemma 3: {"sliding_attention": ..., "full_attention": ...})."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params[layer_type] if layer_type is not None else params)
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def rotary_dim(config: Any, head_dim: int, layer_type: str | None = None) -> int:
    """How many of a head's dimensions rotate (all, unless the config has a partial factor)."""
    params = rope_parameters(config, layer_type)
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    return int(head_dim * factor)


def inverse_frequencies(
    config: Any, head_dim: int, layer_type: str | None = None, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """float32 frequencies [rotary_dim / 2] on the CPU, and the attention factor (`seq_len`:
    the sequence length LongRoPE picks its set of frequencies by).

    The CPU even under another device context: transformers' rope functions make some
    tensors on the ambient device and move others to the one they are given, so any other
    choice would mix devices.
    """
    with torch.device("cpu"):
        return _inverse_frequencies(config, head_dim, layer_type, seq_len)


def _inverse_frequencies(
    config: Any, head_dim: int, layer_type: str | None, seq_len: int | None
) -> tuple[torch.Tensor, float]:
    params = rope_parameters(config, layer_type)
    rope_type = params["rope_type"]
    if rope_type == "default":
        dim = rotary_dim(config, head_dim, layer_type)
        exponents = torch.arange(0, dim, 2, dtype=torch.float) / dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    if rope_type == "dynamic":
        # Dynamic NTK changes the frequencies with the running sequence length; a step plan
        # mixes many lengths, so one cos/sin table cannot serve it.
        raise ValueError("rope_type 'dynamic' is not supported; use a fixed scaling such as 'linear' or 'yarn'")
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unknown rope_type {rope_type!r}")
    kwargs: dict[str, Any] = {"layer_type": layer_type} if layer_type is not None else {}
    if seq_len is not None:
        kwargs["seq_len"] = seq_len
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **kwargs)
    return inv_freq.float(), float(attention_factor)


class RotaryEmbedding(nn.Module):
    """`lookup` once per step, `rotate` per layer; `kernels` "triton" or "cpu" rotates in place
    with our kernel."""

    def __init__(
        self,
        config: Any,
        head_dim: int,
        max_positions: int,
        dtype: torch.dtype,
        kernels: str = "torch",
        layer_type: str | None = None,
    ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim(config, head_dim, layer_type)
        self.fused = kernels != "torch" and self.rotary_dim == head_dim
        self._cpu = cpu_kernels_for(kernels) if self.fused else None
        inv_freq, factor = inverse_frequencies(config, head_dim, layer_type)
        positions = torch.arange(max_positions, dtype=torch.float, device="cpu")
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, rotary_dim / 2]
        params = rope_parameters(config, layer_type)
        if params["rope_type"] == "longrope":
            original = params["original_max_position_embeddings"]
            long_freq, _ = inverse_frequencies(config, head_dim, layer_type, seq_len=original + 1)
            past = positions >= original
            freqs[past] = positions[past, None] * long_freq[None, :]
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", _to_ambient_device((freqs.cos() * factor).to(dtype)), persistent=False)
        self.register_buffer("sin", _to_ambient_device((freqs.sin() * factor).to(dtype)), persistent=False)

    def lookup(self, positions: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """What every layer of this step needs: cos, sin [tokens, 1, head_dim / 2] gathered once,
        or, fused, the positions themselves (the kernel reads the tables)."""
        if self.fused:
            return positions
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def rotate(
        self, rope: torch.Tensor | tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]."""
        if isinstance(rope, torch.Tensor):
            if self._cpu is not None:
                # The runner checked the plan's positions against the context, which the
                # tables cover (ModelRunner.check).
                self._cpu.rotary(q, k, rope, self.cos, self.sin, bounds_checked=True)
            else:
                apply_rotary(q, k, rope, self.cos, self.sin)
            return q, k
        cos, sin = rope
        if self.rotary_dim < q.shape[-1]:
            d = self.rotary_dim
            return (
                torch.cat((_rotate(q[..., :d], cos, sin), q[..., d:]), dim=-1),
                torch.cat((_rotate(k[..., :d], cos, sin), k[..., d:]), dim=-1),
            )
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _to_ambient_device(table: torch.Tensor) -> torch.Tensor:
    """A copy of `table` made where the model's parameters are: on the device of the enclosing
    `torch.device(...)` block, else the default one."""
    return torch.empty(table.shape, dtype=table.dtype).copy_(table)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
