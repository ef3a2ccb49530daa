"""AdapterSlots: reference counts, least-recently-released refills, loads recorded once."""

from __future__ import annotations

import pytest

from common.plan import AdapterLoad
from scheduler_svc.lora.adapter_registry import Adapter
from scheduler_svc.lora.adapter_slots import AdapterSlots


def adapter(name: str, version: int = 1) -> Adapter:
    return Adapter(name, f"/adapters/{name}", version, 8, 2.0, ("q_proj",))


A, B, C = adapter("a"), adapter("b"), adapter("c")


def test_first_acquires_fill_empty_slots_in_order_and_record_loads() -> None:
    slots = AdapterSlots(2)
    assert slots.acquire(A) == 0 and slots.acquire(B) == 1
    assert slots.take_loads() == (AdapterLoad(0, "a", "/adapters/a", 1), AdapterLoad(1, "b", "/adapters/b", 1))
    assert slots.take_loads() == ()  # drained
    assert slots.num_loads == 2
    slots.check_integrity({("a", 1): 1, ("b", 1): 1})


def test_a_resident_adapter_is_acquired_without_a_load() -> None:
    slots = AdapterSlots(2)
    slots.acquire(A)
    slots.take_loads()
    assert slots.acquire(A) == 0  # a second group of the same adapter
    assert slots.take_loads() == () and slots.num_loads == 1
    assert slots.refs == [2, 0]
    slots.check_integrity({("a", 1): 2})


def test_an_idle_slot_keeps_its_adapter_for_reuse() -> None:
    slots = AdapterSlots(2)
    slots.acquire(A)
    slots.release(A)
    slots.check_integrity({})
    assert slots.resident == {("a", 1): 0}
    assert slots.acquire(A) == 0
    assert slots.num_loads == 1


def test_the_least_recently_released_idle_slot_is_refilled() -> None:
    slots = AdapterSlots(2)
    slots.acquire(A)
    slots.acquire(B)
    slots.release(B)  # b idle first
    slots.release(A)
    assert slots.acquire(C) == 1  # b's slot: released before a's
    assert slots.resident == {("a", 1): 0, ("c", 1): 1}
    assert slots.take_loads()[-1] == AdapterLoad(1, "c", "/adapters/c", 1)
    # b must now be loaded again, into a's idle slot.
    assert slots.acquire(B) == 0 and slots.num_loads == 4


def test_empty_slots_go_before_idle_loaded_ones() -> None:
    slots = AdapterSlots(3)
    slots.acquire(A)
    slots.release(A)
    assert slots.acquire(B) == 1 and slots.acquire(C) == 2
    assert slots.resident[("a", 1)] == 0


def test_a_referenced_slot_is_never_refilled() -> None:
    slots = AdapterSlots(1)
    slots.acquire(A)
    assert not slots.can_acquire(B)
    assert slots.can_acquire(A)  # resident: no slot needed
    with pytest.raises(RuntimeError, match="no idle LoRA slot"):
        slots.acquire(B)
    slots.release(A)
    assert slots.can_acquire(B)
    assert slots.acquire(B) == 0


def test_a_new_version_of_a_name_is_another_adapter() -> None:
    slots = AdapterSlots(2)
    old, new = adapter("a", 1), adapter("a", 2)
    slots.acquire(old)
    assert slots.acquire(new) == 1
    assert [load.version for load in slots.take_loads()] == [1, 2]


def test_over_release_and_integrity_mismatches_are_caught() -> None:
    slots = AdapterSlots(2)
    slots.acquire(A)
    with pytest.raises(AssertionError):
        slots.check_integrity({})  # a reference no running group holds
    with pytest.raises(AssertionError):
        slots.check_integrity({("a", 1): 2})
    with pytest.raises(AssertionError):
        slots.check_integrity({("b", 1): 1})
    slots.release(A)
    with pytest.raises(RuntimeError, match="released more often"):
        slots.release(A)


def test_only_the_last_load_of_a_slot_is_carried() -> None:
    """A load no plan carried yet is superseded by a later load into the same slot."""
    slots = AdapterSlots(1)
    slots.acquire(A)
    slots.release(A)
    slots.acquire(B)
    assert slots.take_loads() == (AdapterLoad(0, "b", "/adapters/b", 1),)


def test_reset_forgets_contents_but_keeps_counting() -> None:
    slots = AdapterSlots(2)
    slots.acquire(A)
    epoch = slots.epoch
    slots.reset()
    assert slots.epoch != epoch and slots.resident == {} and slots.refs == [0, 0]
    assert slots.take_loads() == ()
    assert slots.acquire(A) == 0 and slots.num_loads == 2  # loaded again: the workers lost it
    slots.check_integrity({("a", 1): 1})


def test_no_slots_acquire_nothing() -> None:
    slots = AdapterSlots(0)
    assert not slots.can_acquire(A)
    slots.check_integrity({})
