"""Scratch buffers reused across kernel launches.

Split-K kernels need partial results between their two launches. Allocating them per call
would put an allocation on the launch path (and inside any captured CUDA graph); instead one
float32 buffer per device grows to the largest request seen and is sliced for each call.

A captured graph keeps the address the buffer had at capture, so whoever captures reserves,
before the first capture, as much as any of its graphs will ask for (`reserve`): a buffer
that grew between two captures would leave the earlier graphs reading freed memory.
"""

from __future__ import annotations

import torch

_buffers: dict[torch.device, torch.Tensor] = {}

# Each view starts on a 16-byte boundary: Triton specialises a pointer on that alignment, so
# views at offsets that follow the step's sizes would compile a kernel variant per alignment.
ALIGN = 4  # float32 elements


def device_key(device: torch.device | str) -> torch.device:
    """The one key a device's buffer is kept under: a bare "cuda" and "cuda:0" (when 0 is the
    current device) are different dict keys but the same memory, and must share one buffer."""
    device = torch.device(device)
    if device.type == "cpu":
        return torch.device("cpu")  # "cpu:0" too: CPU tensors report a bare "cpu"
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def elements(*sizes: int) -> int:
    """Elements a `workspace(device, *sizes)` call takes, alignment padding included."""
    return sum(-(-n // ALIGN) * ALIGN for n in sizes)


def buffer(device: torch.device | str) -> torch.Tensor | None:
    """The device's buffer as it is now (None before the first request): what a captured graph
    reads, to be kept alive while the graph is."""
    return _buffers.get(device_key(device))


def reserve(device: torch.device | str, total: int) -> torch.Tensor:
    """Grow the device's buffer to at least `total` elements now, so that no later request up
    to that size reallocates it."""
    key = device_key(device)
    buf = _buffers.get(key)
    if buf is None or buf.numel() < total:
        buf = torch.empty(max(total, 2 * (buf.numel() if buf is not None else 0)), dtype=torch.float32, device=key)
        _buffers[key] = buf
    return buf


def workspace(device: torch.device, *sizes: int) -> list[torch.Tensor]:
    """Disjoint float32 views of the given element counts, valid until the next call."""
    buf = reserve(device, elements(*sizes))
    views, start = [], 0
    for n in sizes:
        views.append(buf[start : start + n])
        start += -(-n // ALIGN) * ALIGN
    return views
