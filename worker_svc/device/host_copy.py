"""Moving a step's arrays between the host and the device without waiting for the device.

Each `.cpu()` of a CUDA tensor waits for the device to finish everything queued before it;
a step that fetched its tokens, then their log-probabilities, then the alternatives, waited
three times, and the host could queue nothing meanwhile. Here every copy is queued first
(into pinned memory) and the host waits once.

The other way, a plain `.to(device)` of a host tensor is a copy followed by a wait for the
stream; the sampler and logits processor upload a dozen small arrays per step, so each
upload is queued instead (`to_device`). Up to about 64 KiB, CUDA copies pageable memory into
a staging buffer of its own and returns; beyond, it stages the bytes synchronously, chunk by
chunk. Larger arrays therefore go through a ring of pinned buffers (`PinnedRing`): the host
writes the array into the next slot and the copy from it is truly queued.

    slot:    0      1      2      3      0 ...
    upload:  a      b      c      d      e       e waits for a's copy (its event), not for
                                                 the device's whole queue, then reuses slot 0
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

PINNED_ABOVE = 64 * 1024  # bytes: smaller uploads CUDA already queues from pageable memory


class Waitable(Protocol):
    def synchronize(self) -> None: ...


def _pin(nbytes: int) -> torch.Tensor:
    # Without CUDA there is no pinned allocator, and nothing a page-locked buffer would speed up.
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())


def _record(device: torch.device) -> Waitable:
    """An event after everything queued on the device's current stream (the copy just made)."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class PinnedRing:
    """Pinned host buffers reused round-robin for host-to-device copies.

    A slot is rewritten only after the copy that last read it has finished (its event), so
    an upload never changes bytes still in flight. A slot grows (doubling) to the largest
    array it is asked to hold. `pin` and `record` are injectable so that the bookkeeping runs
    on a machine without CUDA; copies to a CPU target are synchronous and record nothing.
    """

    def __init__(
        self,
        slots: int = 8,
        pin: Callable[[int], torch.Tensor] = _pin,
        record: Callable[[torch.device], Waitable] = _record,
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        self._pin, self._record = pin, record
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._events: list[Waitable | None] = [None] * slots
        self._next = 0
        self._lock = threading.Lock()  # uploads from two threads must not share a slot

    def upload(
        self,
        a: np.ndarray,
        device: torch.device,
        dtype: torch.dtype | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`a` on `device` (into `out` when given: a tensor there of `a`'s shape), queued."""
        src = torch.from_numpy(np.ascontiguousarray(a))
        dtype = dtype or (out.dtype if out is not None else src.dtype)
        with self._lock:
            slot = self._next
            self._next = (slot + 1) % len(self._buffers)
            event, self._events[slot] = self._events[slot], None
            if event is not None:
                event.synchronize()
            nbytes = src.numel() * dtype.itemsize
            buf = self._buffers[slot]
            if buf is None or buf.numel() < nbytes:
                buf = self._pin(max(nbytes, 2 * (buf.numel() if buf is not None else 0)))
                self._buffers[slot] = buf
            host = buf[:nbytes].view(dtype).view(src.shape)
            host.copy_(src)  # a dtype change happens here, on the host: the copy stays pinned
            if out is None:
                out = torch.empty(src.shape, dtype=dtype, device=device)
            out.copy_(host, non_blocking=True)
            if device.type == "cuda":
                self._events[slot] = self._record(device)
        return out


_ring = PinnedRing()


def to_device(a: np.ndarray, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host array on `device` (a view of it when that is the CPU), queued, never waited for."""
    if device.type == "cuda" and a.nbytes > PINNED_ABOVE:
        return _ring.upload(a, device, dtype)
    return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype, non_blocking=True)


def to_host(*tensors: torch.Tensor) -> list[np.ndarray]:
    """The tensors as numpy arrays (views of CPU tensors; copies of device ones)."""
    device = next((t.device for t in tensors if t.device.type != "cpu"), None)
    if device is None:
        return [t.numpy() for t in tensors]
    host = [t.to("cpu", non_blocking=True) for t in tensors]
    torch.cuda.current_stream(device).synchronize()
    return [h.numpy() for h in host]
