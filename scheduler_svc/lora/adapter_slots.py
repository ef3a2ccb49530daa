"""Which LoRA adapter sits in which device slot of one worker group, and who uses it.

Like KV blocks, slots are capacity the scheduler plans: a group of requests acquires its
adapter's slot when it starts running and releases it when it stops (preempted, finished,
aborted). A slot whose adapter nobody runs stays loaded, so a later request for that adapter
needs no load; when an adapter without a slot comes, the least recently released idle slot is
refilled. A referenced slot is never refilled, so a step holds at most `num_slots` distinct
adapters and no row's weights change under it. Each refill is recorded as an AdapterLoad that the
next plan carries (`take_loads`), before that plan's forward pass.
"""

from __future__ import annotations

from collections import OrderedDict

from common.plan import AdapterLoad
from scheduler_svc.lora.adapter_registry import Adapter

Key = tuple[str, int]  # (name, version)


def _key(adapter: Adapter) -> Key:
    return (adapter.name, adapter.version)


class AdapterSlots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.num_loads = 0
        # Changes whenever an adapter may have moved to another slot (a load, a reset), so that
        # a plan builder caching rows' slots knows to look again.
        self.epoch = 0
        self.reset()

    def reset(self) -> None:
        """Forget every slot's contents (the worker group's slots are gone with it); counters stay."""
        n = self.num_slots
        self.refs = [0] * n
        self._held: list[Key | None] = [None] * n  # what each slot holds on the workers
        self._slot_of: dict[Key, int] = {}
        # Slots nobody references, least recently released first (empty ones first of all).
        self._idle: OrderedDict[int, None] = OrderedDict((s, None) for s in range(n))
        self._loads: list[AdapterLoad] = []
        self.epoch += 1

    @property
    def resident(self) -> dict[Key, int]:
        """Adapters the workers hold, referenced or idle, by slot."""
        return dict(self._slot_of)

    def slot_of(self, adapter: Adapter) -> int:
        """The slot of an adapter a running group holds (acquired)."""
        return self._slot_of[_key(adapter)]

    def can_acquire(self, adapter: Adapter) -> bool:
        return _key(adapter) in self._slot_of or bool(self._idle)

    def acquire(self, adapter: Adapter) -> int:
        key = _key(adapter)
        slot = self._slot_of.get(key)
        if slot is None:
            if not self._idle:
                raise RuntimeError(f"no idle LoRA slot for adapter {adapter.name!r}")
            slot = next(iter(self._idle))
            old = self._held[slot]
            if old is not None:
                del self._slot_of[old]
            self._held[slot] = key
            self._slot_of[key] = slot
            self._loads.append(AdapterLoad(slot, adapter.name, adapter.path, adapter.version))
            self.num_loads += 1
            self.epoch += 1
        if self.refs[slot] == 0:
            del self._idle[slot]
        self.refs[slot] += 1
        return slot

    def release(self, adapter: Adapter) -> None:
        slot = self._slot_of[_key(adapter)]
        if self.refs[slot] <= 0:
            raise RuntimeError(f"LoRA slot {slot} released more often than acquired")
        self.refs[slot] -= 1
        if self.refs[slot] == 0:
            self._idle[slot] = None  # the most recently released: evicted last

    def take_loads(self) -> tuple[AdapterLoad, ...]:
        """The loads since the last plan, the last one per slot: a load no plan carried yet (its
        group was admitted into a plan that then sent nothing, and aborted) is superseded."""
        last = {load.slot: load for load in self._loads}
        self._loads = []
        return tuple(last.values())

    def check_integrity(self, held: dict[Key, int]) -> None:
        """`held`: running groups per adapter key. Refs match them; idle slots are the unreferenced."""
        for key, count in held.items():
            slot = self._slot_of.get(key)
            if slot is None or self.refs[slot] != count:
                raise AssertionError(f"adapter {key[0]!r} runs in {count} groups, its slot says otherwise")
        if sum(self.refs) != sum(held.values()):
            raise AssertionError("a LoRA slot is referenced by no running group")
        if set(self._idle) != {s for s in range(self.num_slots) if self.refs[s] == 0}:
            raise AssertionError("the idle LoRA slots and the reference counts disagree")
        if any(self._held[s] != k for k, s in self._slot_of.items()):
            raise AssertionError("the LoRA slot index and the slots disagree")
