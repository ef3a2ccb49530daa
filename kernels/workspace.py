"""Scratch buffers reused across kernel launches.

Split-K kernels need partial results between their two launches. Allocating them per call
would put an allocation on the launch path (and inside any captured CUDA graph); instead one
float32 buffer per device grows to the largest request seen and is sliced for each call.
"""

from __future__ import annotations

import torch

_buffers: dict[torch.device, torch.Tensor] = {}

# Each view starts on a 16-byte boundary: Triton specialises a pointer on that alignment, so
# views at offsets that follow the step's sizes would compile a kernel variant per alignment.
ALIGN = 4  # float32 elements


def workspace(device: torch.device, *sizes: int) -> list[torch.Tensor]:
    """Disjoint float32 views of the given element counts, valid until the next call."""
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + -(-n // ALIGN) * ALIGN)
    total = starts[-1]
    buf = _buffers.get(device)
    if buf is None or buf.numel() < total:
        buf = torch.empty(max(total, 2 * (buf.numel() if buf is not None else 0)), dtype=torch.float32, device=device)
        _buffers[device] = buf
    return [buf[start : start + n] for start, n in zip(starts, sizes)]
