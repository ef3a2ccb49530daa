"""Tensor-parallel layers (Megatron-style), each owning its sharding rule via `weight_loader`.

With a group of tp ranks, rank r keeps:

    ColumnParallelLinear      rows (outputs) [r*out/tp, (r+1)*out/tp) of W and b; output stays split
    MergedColumnParallelLinear  gate_up_proj: rank r's rows of gate, then rank r's rows of up
    QKVParallelLinear         qkv_proj: its query heads, then its KV heads for k and for v
    RowParallelLinear         columns (inputs) [r*in/tp, (r+1)*in/tp) of W; all-reduce, then + b
    VocabParallelEmbedding    vocab rows [r*V'/tp, (r+1)*V'/tp), V' = V padded to a multiple of tp
    ParallelLMHead            the same vocab rows as the embedding (or the embedding's own, if tied)

Fused parameters are filled from several checkpoint tensors, told apart by a shard id:

    qkv_proj.weight     rows [ q (heads/tp * head_dim) | k (kv/tp * head_dim) | v (same) ]
    gate_up_proj.weight rows [ gate (intermediate/tp) | up (intermediate/tp) ]

KV heads: when tp <= kv_heads each rank keeps kv_heads/tp of them; when tp > kv_heads (tp a
multiple of kv_heads) rank r keeps KV head r // (tp / kv_heads), the one its query heads
read (its query heads are a contiguous run inside one GQA group), so those KV heads are
replicated on tp / kv_heads ranks.

The vocabulary is padded rather than refused: a rank's padding rows are zero, ids outside
its range embed to zero before the all-reduce, and the gathered logits are cut back to V.

With tp = 1 every layer is one F.linear / F.embedding over the whole weight, exactly what the
single-process worker computed before.

On the CPU, `pack_for_cpu` packs a bfloat16 weight once for the GEMM that reads it
(kernels/cpu_linear.py: our AVX512-BF16 kernel, else oneDNN's blocked layout), instead of
F.linear reordering it on every call. The plain copy is then dropped (except the embedding's,
which a tied LM head shares).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu_linear import PackedLinear, can_pack
from worker_svc.device.parallel import ParallelGroup
from worker_svc.layers.replicated import Loaded, RowWindow, copy_checked, load_replicated, loaded_shape


class LoraStep(Protocol):
    @property
    def active(self) -> frozenset[int]: ...  # the adapter slots some token of the step uses


class LoraUpdate(Protocol):
    """A LoRA update added to a linear's output in place (worker_svc/lora/lora_slots.py). The linear
    tests `step.active` first: a step without adapted rows makes no call at all."""

    @property
    def step(self) -> LoraStep: ...

    def add(self, x: torch.Tensor, out: torch.Tensor) -> None: ...


class Shard(NamedTuple):
    """What one rank keeps of one checkpoint tensor along the split dimension."""

    size: int  # rows (or columns) this rank holds
    start: int  # where they start in the checkpoint tensor
    total: int  # the checkpoint tensor's size along that dimension


def _even(total: int, group: ParallelGroup, what: str) -> Shard:
    if total % group.world_size:
        raise ValueError(f"tp={group.world_size} cannot split {what} of {total}")
    size = total // group.world_size
    return Shard(size, group.rank * size, total)


def _param(*shape: int, dtype: torch.dtype | None) -> nn.Parameter:
    """Uninitialised, in the model's dtype on the ambient device: the loader fills it (see
    worker_svc/layers/replicated.py on why never float32 first)."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def _linear(
    x: torch.Tensor, weight: torch.Tensor, packed: PackedLinear | None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    if packed is not None:
        return packed(x, bias)
    return F.linear(x, weight, bias)


def _drop(param: nn.Parameter) -> None:
    """Free a weight whose packed copy replaces it (the parameter stays, empty)."""
    param.data = torch.empty(0, dtype=param.dtype, device=param.device)


class ColumnParallelLinear(nn.Module):
    """y[..., local outputs] = x W_r^T + b_r: this rank's output rows; the output stays split.

    `shards` names the checkpoint tensors that fill consecutive row ranges of the parameter
    (one unnamed shard for a plain layer) and which rows of each this rank reads.
    """

    def __init__(
        self, in_features: int, shards: dict[str, Shard], bias: bool = False, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.shards = shards
        self.in_features = in_features
        self.lora: LoraUpdate | None = None  # set when the worker serves LoRA adapters
        out_local = sum(s.size for s in shards.values())
        self.weight = _param(out_local, in_features, dtype=dtype)  # [out / tp, in]
        self.bias = _param(out_local, dtype=dtype) if bias else None
        self.packed: PackedLinear | None = None  # see pack_for_cpu
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
                param.shard_ids = tuple(shards)  # type: ignore[attr-defined]

    @classmethod
    def plain(
        cls,
        in_features: int,
        out_features: int,
        group: ParallelGroup,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> ColumnParallelLinear:
        return cls(in_features, {"": _even(out_features, group, "output features")}, bias, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: str | None = None) -> None:
        if shard_id is None and len(self.shards) > 1:
            self._load_fused(param, loaded)
            return
        key = shard_id or ""
        if key not in self.shards:
            raise ValueError(f"unknown shard {shard_id!r}, this layer has {sorted(self.shards)}")
        offset = 0
        for name, s in self.shards.items():
            if name == key:
                break
            offset += s.size
        shard = self.shards[key]
        what = f"shard {key or 'weight'}"
        rows = loaded_shape(loaded)[0]
        if rows != shard.total:
            raise ValueError(f"{what}: checkpoint tensor has {rows} rows, the model wants {shard.total}")
        copy_checked(param.data[offset : offset + shard.size], loaded[shard.start : shard.start + shard.size], what)

    def _load_fused(self, param: nn.Parameter, loaded: Loaded) -> None:
        """A checkpoint that stores the parts already fused, in our order (Phi-3's qkv_proj and
        gate_up_proj): each part's rows go to its shard's loader."""
        rows = loaded_shape(loaded)[0]
        want = sum(s.total for s in self.shards.values())
        if rows != want:
            raise ValueError(f"fused weight: checkpoint tensor has {rows} rows, the model wants {want}")
        start = 0
        for name, shard in self.shards.items():
            self.weight_loader(param, RowWindow(loaded, start, shard.total), name)
            start += shard.total

    def pack_for_cpu(self) -> None:
        self.packed = PackedLinear(self.weight)
        _drop(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _linear(x, self.weight, self.packed, self.bias)
        if self.lora is not None and self.lora.step.active:
            self.lora.add(x, y)
        return y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """gate_up_proj: [hidden] -> [gate_r | up_r], each of intermediate / tp."""

    def __init__(
        self,
        in_features: int,
        intermediate_size: int,
        group: ParallelGroup,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        shard = _even(intermediate_size, group, "an MLP intermediate size")
        super().__init__(in_features, {"gate": shard, "up": shard}, bias, dtype)

    def pack_for_cpu(self) -> None:
        # In halves where our GEMM can: then silu_and_mul runs on its accumulators.
        self.packed = PackedLinear(self.weight, halves=can_pack(self.weight, halves=True))
        _drop(self.weight)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up straight from the GEMM (weights packed in halves), or None where it
        cannot: no such packing, or a LoRA adapter adds to this step's gate and up."""
        if self.packed is None or not self.packed.halves or (self.lora is not None and self.lora.step.active):
            return None
        return self.packed.activated(x, self.bias)


def kv_head_range(num_kv_heads: int, group: ParallelGroup) -> tuple[int, int]:
    """(first KV head, count) this rank keeps: a split, or one replicated head when tp > kv heads."""
    tp, r = group.world_size, group.rank
    if tp <= num_kv_heads:
        per = num_kv_heads // tp
        return r * per, per
    return r // (tp // num_kv_heads), 1


class QKVParallelLinear(ColumnParallelLinear):
    """qkv_proj: [hidden] -> [q_r | k_r | v_r]; rank r's query heads and the KV heads they read."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        group: ParallelGroup,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        d = head_dim
        q = _even(num_heads, group, "attention heads")
        kv_start, kv_count = kv_head_range(num_kv_heads, group)
        kv = Shard(kv_count * d, kv_start * d, num_kv_heads * d)
        super().__init__(
            hidden_size, {"q": Shard(q.size * d, q.start * d, num_heads * d), "k": kv, "v": kv}, bias, dtype
        )
        self.num_heads, self.num_kv_heads = q.size, kv_count  # this rank's


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W_r^T, + b once: x arrives split along its last dim."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: ParallelGroup,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.group = group
        self.out_features = out_features
        self.lora: LoraUpdate | None = None  # set when the worker serves LoRA adapters
        self.shard = _even(in_features, group, "input features")
        self.weight = _param(out_features, self.shard.size, dtype=dtype)  # [out, in / tp]
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.packed: PackedLinear | None = None  # see pack_for_cpu
        self.bias = _param(out_features, dtype=dtype) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = load_replicated  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: str | None = None) -> None:
        shape = loaded_shape(loaded)
        if len(shape) != 2 or shape[1] != self.shard.total:
            raise ValueError(
                f"weight: checkpoint tensor has shape {shape}, the model wants [{param.shape[0]}, {self.shard.total}]"
            )
        copy_checked(param.data, loaded[:, self.shard.start : self.shard.start + self.shard.size], "weight")

    def pack_for_cpu(self) -> None:
        self.packed = PackedLinear(self.weight)
        _drop(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group.world_size == 1:
            y = _linear(x, self.weight, self.packed, self.bias)
            if self.lora is not None and self.lora.step.active:
                self.lora.add(x, y)
            return y
        partial = _linear(x, self.weight, self.packed)
        # This rank's share of the update: linear in x, so the reduce sums it.
        if self.lora is not None and self.lora.step.active:
            self.lora.add(x, partial)
        # The bias joins after the reduce: added on every rank before it, it would count tp times.
        y = self.group.all_reduce(partial)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Each rank embeds the ids of its vocab range (others give 0); the all-reduce sums them."""

    def __init__(
        self, vocab_size: int, hidden_size: int, group: ParallelGroup, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.group = group
        self.vocab_size = vocab_size
        per = -(-vocab_size // group.world_size)  # padded: the last rank's tail rows stay zero
        self.shard = Shard(per, group.rank * per, vocab_size)
        self.weight = _param(per, hidden_size, dtype=dtype)  # [V' / tp, hidden]
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: str | None = None) -> None:
        shape = loaded_shape(loaded)
        if shape != (self.vocab_size, param.shape[1]):
            raise ValueError(
                f"weight: checkpoint tensor has shape {shape}, the model wants {(self.vocab_size, param.shape[1])}"
            )
        start = min(self.shard.start, self.vocab_size)
        end = min(self.shard.start + self.shard.size, self.vocab_size)
        param.data[end - start :].zero_()
        copy_checked(param.data[: end - start], loaded[start:end], "weight")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.shard.start
        outside = (local < 0) | (local >= self.shard.size)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # [tokens, hidden]
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(x)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the rank's vocab rows, all-gathered: every rank gets the full [n, vocab].

    All ranks gather (not only rank 0) so each one samples the same tokens from the same plan
    and the runner's control flow, with its collectives, never differs between ranks; rank 0's
    tokens are the ones returned. `tied` shares the embedding's shard instead of holding one.
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        group: ParallelGroup,
        tied: VocabParallelEmbedding | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if tied is None:
            super().__init__(vocab_size, hidden_size, group, dtype)
        else:
            nn.Module.__init__(self)
            self.group, self.vocab_size, self.shard = group, vocab_size, tied.shard
            self.weight = tied.weight  # the same Parameter: loaded once, as the embedding
        self.tied = tied is not None
        self.packed: PackedLinear | None = None  # see pack_for_cpu

    def pack_for_cpu(self) -> None:
        self.packed = PackedLinear(self.weight)
        if not self.tied:  # a tied weight still embeds the input ids
            _drop(self.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] in the weight's dtype."""
        logits = _linear(hidden, self.weight, self.packed)  # [n, V' / tp]
        if self.group.world_size > 1:
            logits = self.group.all_gather(logits, -1)[:, : self.vocab_size]
        return logits
