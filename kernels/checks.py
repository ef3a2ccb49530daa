"""Argument checks and launch helpers shared by every kernel wrapper.

Each public wrapper validates shapes, dtypes, devices and strides before launching, because a
Triton kernel does no bounds checks: a wrong stride reads someone else's memory silently.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Launch:
    """Tile extents and launch options an attention wrapper picks for one launch.

    One place per kernel decides them (`prefill_launch`, `decode_launch`) so that the offline
    compile checks (tests/compile_kernels.py, benchmarks/kernel_resources.py) measure exactly
    what the wrappers launch.
    """

    rows: int  # query rows per program: a tile of tokens (prefill), the padded head group (decode)
    keys: int  # KV tokens per inner iteration
    num_warps: int
    num_stages: int  # depth of the K/V load pipeline (cp.async) on a GPU

    def __post_init__(self) -> None:
        for name in ("rows", "keys", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be at least 1, got {self.num_stages}")


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (kernels run on CPU tensors with numpy)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def native_dot(dtype: torch.dtype) -> bool:
    """Whether tl.dot may take the tensors' own 16-bit dtype.

    The interpreter computes bf16 dots wrongly, so there everything is widened to float32
    right after loading; on a GPU 16-bit dots run on tensor cores with float32 accumulation.
    """
    return dtype != torch.float32 and not interpreting()


def dot_precision(dtype: torch.dtype) -> str:
    """float32 dots stay exact ("ieee", no TF32); for 16-bit inputs the setting does not apply."""
    return "ieee" if dtype == torch.float32 or interpreting() else "tf32"


def pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum) (tile extents must be powers of two)."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def fail(name: str, message: str) -> None:
    raise ValueError(f"{name}: {message}")


def check_tensor(
    name: str,
    t: torch.Tensor,
    ndim: int,
    dtypes: tuple[torch.dtype, ...],
    device: torch.device | None = None,
    contiguous_last: bool = True,
) -> None:
    if not isinstance(t, torch.Tensor):
        fail(name, f"expected a tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        fail(name, f"expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        fail(name, f"dtype {t.dtype} not in {', '.join(str(d) for d in dtypes)}")
    if device is not None and t.device != device:
        fail(name, f"on {t.device}, expected {device} like the other inputs")
    if contiguous_last and t.numel() and t.stride(-1) != 1:
        fail(name, f"the last dimension must be contiguous (stride 1), got strides {t.stride()}")


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        fail(name, f"expected shape {shape}, got {tuple(t.shape)}")


def check_cache(
    k_cache: torch.Tensor, v_cache: torch.Tensor, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    """k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], same dtype as q."""
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, c, 4, (dtype,), device=None)
        if c.shape[2:] != (num_kv_heads, head_dim):
            fail(name, f"expected [num_blocks, block_size, {num_kv_heads}, {head_dim}], got {tuple(c.shape)}")
        if c.shape[1] & (c.shape[1] - 1):
            fail(name, f"block_size must be a power of two, got {c.shape[1]}")
    if k_cache.shape != v_cache.shape:
        fail("v_cache", f"shape {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}")


def check_block_tables(
    block_ids: torch.Tensor, block_offsets: torch.Tensor, num_seqs: int, device: torch.device
) -> None:
    """Ragged block tables (common/block_tables.py): int32 block_ids [total] and int32
    block_offsets [num_seqs + 1], contiguous, on `device`; row i's j-th block is
    block_ids[block_offsets[i] + j].

    Only the structure is checked: the values would have to be read back from the device. The
    worker checks them on the host, from the plan (BlockTables.validate, the runner's checks).
    """
    check_tensor("block_ids", block_ids, 1, (torch.int32,), device=device)
    check_tensor("block_offsets", block_offsets, 1, (torch.int32,), device=device)
    check_shape("block_offsets", block_offsets, (num_seqs + 1,))


def check_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    block_offsets: torch.Tensor,
    seq_lens: torch.Tensor,
) -> tuple[int, int]:
    """Checks both attention kernels share; returns (num_heads, num_kv_heads).

    q [tokens, heads, head_dim]; caches [blocks, block_size, kv_heads, head_dim] of q's dtype
    and device, kv_heads dividing heads; ragged tables (check_block_tables) whose offsets set
    the number of sequences, and int32 seq_lens [seqs].
    """
    check_tensor("q", q, 3, FLOAT_DTYPES)
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2] if k_cache.dim() == 4 else 0
    check_cache(k_cache, v_cache, num_kv_heads, head_dim, q.dtype)
    if k_cache.device != q.device:
        fail("k_cache", f"on {k_cache.device}, q is on {q.device}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        fail("q", f"{num_heads} query heads cannot be grouped over {num_kv_heads} KV heads")
    check_tensor("block_offsets", block_offsets, 1, (torch.int32,), device=q.device)
    if block_offsets.shape[0] == 0:
        fail("block_offsets", "needs num_seqs + 1 entries (a leading 0), got none")
    num_seqs = block_offsets.shape[0] - 1
    check_block_tables(block_ids, block_offsets, num_seqs, q.device)
    check_tensor("seq_lens", seq_lens, 1, (torch.int32,), device=q.device)
    check_shape("seq_lens", seq_lens, (num_seqs,))
    return num_heads, num_kv_heads


def check_out(out: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The caller's output tensor (checked) or a new one shaped like `like`."""
    if out is None:
        return torch.empty_like(like)
    check_tensor("out", out, like.dim(), (like.dtype,), device=like.device)
    check_shape("out", out, tuple(like.shape))
    return out
