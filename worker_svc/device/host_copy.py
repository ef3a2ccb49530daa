"""Moving a step's arrays between the host and the device without waiting for the device.

Each `.cpu()` of a CUDA tensor waits for the device to finish everything queued before it;
a step that fetched its tokens, then their log-probabilities, then the alternatives, waited
three times, and the host could queue nothing meanwhile. Here every copy is queued first
(into pinned memory) and the host waits once.

The other way, a plain `.to(device)` of a host tensor is a copy followed by a wait for the
stream; the sampler and logits processor upload a dozen small arrays per step, so each
upload is queued instead (`to_device`). From pageable memory CUDA stages the bytes before the
call returns, so the numpy array may be dropped at once.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(a: np.ndarray, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host array on `device` (a view of it when that is the CPU), queued, never waited for."""
    return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype, non_blocking=True)


def to_host(*tensors: torch.Tensor) -> list[np.ndarray]:
    """The tensors as numpy arrays (views of CPU tensors; copies of device ones)."""
    device = next((t.device for t in tensors if t.device.type != "cpu"), None)
    if device is None:
        return [t.numpy() for t in tensors]
    host = [t.to("cpu", non_blocking=True) for t in tensors]
    torch.cuda.current_stream(device).synchronize()
    return [h.numpy() for h in host]
