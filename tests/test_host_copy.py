"""The pinned staging ring behind large uploads: slot order, waits before reuse, growth.

The bookkeeping runs on CPU with the pin allocator and the event recorder injected; a fake
event stands in for the CUDA event a real upload records, and logs when it is waited on.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker_svc.device import host_copy
from worker_svc.device.host_copy import PINNED_ABOVE, PinnedRing, to_device


class Recorder:
    """Fake pinning and events: which buffers were allocated and which uploads waited on."""

    def __init__(self) -> None:
        self.pinned: list[int] = []
        self.recorded = 0
        self.waited: list[int] = []
        self.log: list[str] = []  # pins and waits, in order

    def pin(self, nbytes: int) -> torch.Tensor:
        self.pinned.append(nbytes)
        self.log.append(f"pin {nbytes}")
        return torch.empty(nbytes, dtype=torch.uint8)

    def record(self, device: torch.device) -> host_copy.Waitable:
        upload, waited, log = self.recorded, self.waited, self.log
        self.recorded += 1

        class Event:
            def synchronize(self) -> None:
                waited.append(upload)
                log.append(f"wait {upload}")

        return Event()


def upload(ring: PinnedRing, a: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An upload "to CUDA" (so the ring records an event) into a CPU tensor standing in."""
    out = torch.empty(a.shape, dtype=dtype or torch.from_numpy(a).dtype)
    return ring.upload(a, torch.device("cuda", 0), dtype, out=out)


def test_slots_are_reused_in_turn_each_after_its_last_copy() -> None:
    rec = Recorder()
    ring = PinnedRing(3, pin=rec.pin, record=rec.record)
    arrays = [np.full(10, i, np.int64) for i in range(7)]
    outs = [upload(ring, a) for a in arrays]
    # Uploads 0-2 fill the three slots; 3 waits for 0's copy, 4 for 1's, ... never out of turn.
    assert rec.waited == [0, 1, 2, 3]
    assert rec.pinned == [80, 80, 80]  # one buffer per slot, reused
    assert [o.tolist() for o in outs] == [a.tolist() for a in arrays]  # a reuse overwrote no copy


def test_a_slot_grows_to_the_largest_array_it_holds() -> None:
    rec = Recorder()
    ring = PinnedRing(2, pin=rec.pin, record=rec.record)
    small, big = np.arange(4, dtype=np.int32), np.arange(100, dtype=np.int32)
    upload(ring, small)  # slot 0: 16 bytes
    upload(ring, small)  # slot 1: 16 bytes
    got = upload(ring, big)  # slot 0 again: waits for upload 0, then grows (doubling at least)
    upload(ring, small)  # slot 1: fits
    again = upload(ring, big)  # slot 0: already large enough
    # The grown buffer replaces slot 0's only once upload 0's copy has finished.
    assert rec.log == ["pin 16", "pin 16", "wait 0", "pin 400", "wait 1", "wait 2"]
    assert got.tolist() == again.tolist() == big.tolist()


def test_a_dtype_change_happens_on_the_host() -> None:
    rec = Recorder()
    ring = PinnedRing(1, pin=rec.pin, record=rec.record)
    out = upload(ring, np.array([1, 2, 3], np.int64), torch.int32)
    assert rec.pinned == [12]  # the slot holds int32: the copy from it needs no conversion
    assert out.dtype == torch.int32 and out.tolist() == [1, 2, 3]


def test_copies_to_the_cpu_record_nothing() -> None:
    rec = Recorder()
    ring = PinnedRing(1, pin=rec.pin, record=rec.record)
    for i in range(3):
        assert ring.upload(np.full(5, i), torch.device("cpu")).tolist() == [i] * 5
    assert rec.recorded == 0 and rec.waited == []


def test_to_device_on_the_cpu_is_still_a_view() -> None:
    a = np.arange(2 * PINNED_ABOVE // 8, dtype=np.int64)  # above the threshold
    t = to_device(a, torch.device("cpu"))
    a[0] = 42
    assert int(t[0]) == 42


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_uploads_through_a_small_ring_land_intact_on_the_gpu() -> None:
    ring = PinnedRing(2)
    dev = torch.device("cuda")
    arrays = [np.full(PINNED_ABOVE, i, np.int32) for i in range(6)]
    outs = [ring.upload(a, dev) for a in arrays]
    torch.cuda.synchronize()
    assert [int(o.sum()) for o in outs] == [i * PINNED_ABOVE for i in range(6)]
    big = np.arange(PINNED_ABOVE, dtype=np.float32)
    assert torch.equal(to_device(big, dev).cpu(), torch.from_numpy(big))
