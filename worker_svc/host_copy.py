"""Bringing a step's results from the device: one wait for all of them.

Each `.cpu()` of a CUDA tensor waits for the device to finish everything queued before it;
a step that fetched its tokens, then their log-probabilities, then the alternatives, waited
three times, and the host could queue nothing meanwhile. Here every copy is queued first
(into pinned memory) and the host waits once.
"""

from __future__ import annotations

import numpy as np
import torch


def to_host(*tensors: torch.Tensor) -> list[np.ndarray]:
    """The tensors as numpy arrays (views of CPU tensors; copies of device ones)."""
    device = next((t.device for t in tensors if t.device.type != "cpu"), None)
    if device is None:
        return [t.numpy() for t in tensors]
    host = [t.to("cpu", non_blocking=True) for t in tensors]
    torch.cuda.current_stream(device).synchronize()
    return [h.numpy() for h in host]
