"""A worker's LoRA slots: adapter weights on the device, and the batched update of a step.

Every adaptable linear of the model (qkv_proj's q, k, v parts, o_proj, gate_up_proj's gate and
up parts, down_proj) gets zeroed slot tensors for `max_loras` adapters of rank up to
`max_lora_rank`; a plan's AdapterLoad fills one slot (worker_svc/lora/adapter_cache.py reads the files).
Which adapter goes where is the scheduler's: a slot keeps its adapter, like the model keeps its
weights, until a later load replaces it.

A plan's loads are read and checked (`prepare`: host copies, modules, shapes, slots) before the
runner touches its cache, so a bad adapter refuses the plan with nothing changed; the device
copies follow the block operations (`apply`).

Per step the runner sets the tokens' slots (`begin_step`); each adapted linear then adds

    out[t, part] += scale[s] * B[s] @ (A[s] @ x[t])     for s = slot of token t, s >= 0

On CUDA with the Triton kernels, through kernels/lora.py's shrink/expand (tokens sorted by slot
once per step); elsewhere in torch, grouped by slot (one gather, two matmuls and one scatter per
slot the step uses, never a loop over tokens). A step without adapted rows adds nothing at all.

Tensor parallelism: a column-parallel part keeps the rows of B its base weight keeps (and all of
A); a row-parallel layer keeps A's columns its base weight keeps (and all of B) and adds its
partial update before the layer's all-reduce, which sums it with the other ranks'.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from common.config import LoraConfig
from common.plan import AdapterLoad
from kernels.lora import LoraSegments, lora_segments, lora_shrink_expand
from worker_svc.device.host_copy import to_device
from worker_svc.layers.tp_layers import ColumnParallelLinear, RowParallelLinear, Shard
from worker_svc.lora.adapter_cache import AdapterCache, HostAdapter

# module -> (the layer's attribute path, part of a fused column-parallel output, "" = whole)
TARGETS = {
    "q_proj": ("self_attn.qkv_proj", "q"),
    "k_proj": ("self_attn.qkv_proj", "k"),
    "v_proj": ("self_attn.qkv_proj", "v"),
    "o_proj": ("self_attn.o_proj", ""),
    "gate_proj": ("mlp.gate_up_proj", "gate"),
    "up_proj": ("mlp.gate_up_proj", "up"),
    "down_proj": ("mlp.down_proj", ""),
}


@dataclass
class StepSlots:
    """What the adapted linears of one step read. One object per model, updated in place by
    LoraSlots.begin_step: every linear holds it, and tests `active` without a call."""

    active: frozenset[int] = frozenset()  # slots some token of the step uses
    token_slots: torch.Tensor | None = None  # int32 [tokens], -1 = base
    rows: dict[int, torch.Tensor] | None = None  # torch path: token indices of each active slot
    segments: LoraSegments | None = None  # Triton path


class LoraPart:
    """One adapted projection: its slots' A [S, R, in] and B [S, out, R], and where its output
    sits among the linear's output columns."""

    def __init__(
        self,
        module: str,
        a_shape: tuple[int, int],
        b_shape: tuple[int, int],
        columns: slice,
        split: Shard,
        column: bool,
    ) -> None:
        self.module = module
        self.columns = columns  # this part's columns of the linear's (this rank's) output
        self.split = split  # what this rank keeps of B's rows (column) or of A's columns (row)
        self.column = column
        self.a_shape, self.b_shape = a_shape, b_shape
        self.a = torch.empty(0)
        self.b = torch.empty(0)

    def allocate(self, slots: int, rank: int, dtype: torch.dtype) -> None:
        self.a = torch.zeros(slots, rank, self.a_shape[1], dtype=dtype)  # on the ambient device
        self.b = torch.zeros(slots, self.b_shape[0], rank, dtype=dtype)

    def check(self, a: torch.Tensor, b: torch.Tensor, name: str, layer: int) -> None:
        """A [r, in_full], B [out_full, r] of the whole model, r within the slots' rank."""
        split, rank = self.split, a.shape[0]
        full_in, full_out = (self.a.shape[2], split.total) if self.column else (split.total, self.b.shape[1])
        if a.shape != (rank, full_in) or b.shape != (full_out, rank) or rank > self.a.shape[1]:
            raise ValueError(
                f"adapter {name!r}: layer {layer} {self.module} has A {tuple(a.shape)} and B {tuple(b.shape)}, "
                f"this model wants [r, {full_in}] and [{full_out}, r], r <= {self.a.shape[1]}"
            )

    def fill(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """This rank's part of A and B (checked by `check`) into the zeroed slot."""
        split, rank = self.split, a.shape[0]
        if self.column:
            b = b[split.start : split.start + split.size]
        else:
            a = a[:, split.start : split.start + split.size]
        self.a[slot, :rank].copy_(a)
        self.b[slot, :, :rank].copy_(b)


class LoraLayer:
    """The adapted parts of one linear; the linear calls `add(x, out)` after its own matmul."""

    def __init__(self, owner: LoraSlots) -> None:
        self.owner = owner
        self.step = owner.step  # the linear calls `add` only while step.active
        self.parts: list[LoraPart] = []

    def add(self, x: torch.Tensor, out: torch.Tensor) -> None:
        step, slots = self.step, self.owner
        for part in self.parts:
            used = [s for s in step.active if part.module in slots.targets[s]]
            if not used:
                continue
            target = out[:, part.columns]
            if step.segments is not None and step.token_slots is not None:
                lora_shrink_expand(x, part.a, part.b, step.token_slots, slots.scales, target, step.segments)
                continue
            assert step.rows is not None
            for s in used:
                rows, rank = step.rows[s], slots.ranks[s]
                shrunk = x.index_select(0, rows) @ part.a[s, :rank].t()  # [n, r]
                delta = (shrunk @ part.b[s, :, :rank].t()) * slots.scale_values[s]  # [n, out]
                target.index_add_(0, rows, delta.to(out.dtype))


class LoraSlots:
    def __init__(
        self,
        model: torch.nn.Module,
        config: LoraConfig,
        dtype: torch.dtype,
        device: torch.device,
        use_kernels: bool = False,
    ) -> None:
        """`use_kernels`: the Triton shrink/expand (CUDA), else torch grouped by slot."""
        self.config = config
        self.device = device
        self.cache = AdapterCache(config.host_copies, config.max_lora_rank)
        n = config.max_loras
        self.loaded: list[tuple[str, int] | None] = [None] * n  # (name, version) in each slot
        self.targets: list[frozenset[str]] = [frozenset()] * n
        self.ranks = [0] * n
        self.scale_values = [0.0] * n
        self.scales = torch.zeros(n, dtype=torch.float32, device=device)
        self.step = StepSlots()
        self.use_kernels = use_kernels
        self.layers: dict[tuple[int, str], tuple[LoraLayer, LoraPart]] = {}
        with torch.device(device):
            for i, layer in enumerate(model.model.layers):  # type: ignore[union-attr, arg-type]
                self._install(i, layer, dtype)

    def _install(self, index: int, layer: torch.nn.Module, dtype: torch.dtype) -> None:
        by_linear: dict[str, LoraLayer] = {}
        for module, (attr, part) in TARGETS.items():
            linear = layer.get_submodule(attr) if _has(layer, attr) else None
            if not isinstance(linear, (ColumnParallelLinear, RowParallelLinear)):
                continue  # an MoE layer's experts: nothing to adapt
            if isinstance(linear, ColumnParallelLinear):
                offset = 0
                for name, s in linear.shards.items():
                    if name == part:
                        break
                    offset += s.size
                shard = linear.shards[part]
                lora_part = LoraPart(
                    module, (0, linear.in_features), (shard.size, 0), slice(offset, offset + shard.size), shard, True
                )
            else:
                out_features = linear.out_features
                lora_part = LoraPart(
                    module, (0, linear.shard.size), (out_features, 0), slice(0, out_features), linear.shard, False
                )
            lora_part.allocate(self.config.max_loras, self.config.max_lora_rank, dtype)
            holder = by_linear.get(attr)
            if holder is None:
                holder = by_linear[attr] = LoraLayer(self)
                linear.lora = holder
            holder.parts.append(lora_part)
            self.layers[(index, module)] = (holder, lora_part)

    @property
    def max_loras(self) -> int:
        return self.config.max_loras

    def prepare(self, loads: tuple[AdapterLoad, ...]) -> list[tuple[AdapterLoad, HostAdapter]]:
        """The plan's adapters from their host copies (read from the files on a miss), each
        checked against this model; ValueError naming the adapter, with no slot touched."""
        prepared = []
        for load in loads:
            if not 0 <= load.slot < self.max_loras:
                raise ValueError(f"adapter_loads: slot {load.slot} outside [0, {self.max_loras})")
            adapter = self.cache.get(load)
            for (layer, module), (a, b) in adapter.weights.items():
                found = self.layers.get((layer, module))
                if found is None:
                    raise ValueError(f"adapter {adapter.name!r}: layer {layer} has no {module} this worker can adapt")
                found[1].check(a, b, adapter.name, layer)
            prepared.append((load, adapter))
        return prepared

    def apply(self, prepared: list[tuple[AdapterLoad, HostAdapter]]) -> None:
        """Fill the prepared slots (after the block operations, before the forward pass)."""
        for load, adapter in prepared:
            self._fill(load.slot, adapter)
            self.loaded[load.slot] = (load.name, load.version)

    def _fill(self, slot: int, adapter: HostAdapter) -> None:
        self.loaded[slot] = None  # half-filled until the end
        # Zeroed first: a module the new adapter does not target must not keep the old one's.
        for _, part in self.layers.values():
            part.a[slot].zero_()
            part.b[slot].zero_()
        for key, (a, b) in adapter.weights.items():
            _, part = self.layers[key]
            part.fill(slot, a.to(part.a.dtype), b.to(part.b.dtype))
        self.targets[slot] = adapter.modules
        self.ranks[slot] = adapter.rank
        self.scale_values[slot] = adapter.scale
        self.scales[slot] = adapter.scale

    def check(self, lora_slots: np.ndarray, loads: tuple[AdapterLoad, ...]) -> None:
        """Every slot a load or a row names exists, and a row's is loaded (by now, or by this plan)."""
        outside = [load.slot for load in loads if not 0 <= load.slot < self.max_loras]
        if outside:
            raise ValueError(f"adapter_loads: slot {outside[0]} outside [0, {self.max_loras})")
        if not lora_slots.size:
            return
        if int(lora_slots.max()) >= self.max_loras:
            raise ValueError(f"lora_slots: slot {int(lora_slots.max())} outside [0, {self.max_loras})")
        filled = {s for s, held in enumerate(self.loaded) if held is not None} | {load.slot for load in loads}
        empty = sorted(set(lora_slots[lora_slots >= 0].tolist()) - filled)
        if empty:
            raise ValueError(f"lora_slots: slot {empty[0]} holds no adapter")

    def begin_step(self, token_slots: np.ndarray | None) -> None:
        """The tokens' slots for the next forward pass (int32 [rows], -1 = base; None: no adapter)."""
        step = self.step  # updated in place: every adapted linear holds this object
        if token_slots is None or not token_slots.size or int(token_slots.max()) < 0:
            step.active, step.token_slots, step.rows, step.segments = frozenset(), None, None, None
            return
        active = frozenset(int(s) for s in np.unique(token_slots) if s >= 0)
        slots = to_device(token_slots.astype(np.int32, copy=False), self.device)
        if self.use_kernels:
            step.rows, step.segments = None, lora_segments(slots, self.max_loras)
        else:
            step.rows = {s: to_device(np.flatnonzero(token_slots == s), self.device) for s in active}
            step.segments = None
        step.token_slots = slots
        step.active = active  # last: the linears read the rest only once it is set


def _has(layer: torch.nn.Module, path: str) -> bool:
    try:
        layer.get_submodule(path)
    except AttributeError:
        return False
    return True
