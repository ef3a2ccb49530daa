"""numpy arrays <-> packed little-endian bytes, the wire form of every per-sequence array."""

from __future__ import annotations

from typing import Any

import numpy as np


def pack(array: np.ndarray, dtype: type | str) -> bytes:
    return np.ascontiguousarray(array, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()


def unpack(data: bytes, dtype: type | str, field: str, count: int | None = None) -> np.ndarray[Any, Any]:
    """Decode `data`; a length that is not a whole number of items (or not `count`) is refused."""
    item = np.dtype(dtype).newbyteorder("<")
    if len(data) % item.itemsize:
        raise ValueError(f"{field}: {len(data)} bytes is not a whole number of {item.name} values")
    # A copy: frombuffer views are read-only, and torch.from_numpy wants writable memory.
    array = np.frombuffer(data, dtype=item).astype(np.dtype(dtype), copy=True)
    if count is not None and array.shape[0] != count:
        raise ValueError(f"{field}: {array.shape[0]} values, want {count}")
    return array
