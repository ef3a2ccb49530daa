"""Public wrappers of the CPU kernels (`kernels/cpu/*.cpp`): argument checks, then one C call.

The same calls as the Triton kernels (`kernels/*.py`), for float32 and bfloat16 tensors in
host memory. A wrong stride would make C++ read someone else's memory, so every wrapper checks
shapes, dtypes, devices and strides first. The model calls these hundreds of times a step, so
each wrapper tests its arguments with one cheap expression first and runs the detailed checks
(which name the bad argument) only when that fails. Each kernel runs on torch's intra-op
thread count (`torch.get_num_threads()`), on the same OpenMP pool.

The torch references the tests compare against are the Triton kernels' references
(`kernels.prefill_attention.paged_prefill_attention_reference`, ...) and, for the roundings
the model's torch path makes, the layers of `worker_svc` themselves.
"""

from __future__ import annotations

import torch

from kernels.checks import check_block_tables, check_cache, check_shape, check_tensor, fail
from kernels.cpu_library import load

CPU_DTYPES = (torch.float32, torch.bfloat16)
# Head sizes paged_attention has a kernel for (the C++ code unrolls the head).
ATTENTION_HEAD_DIMS = (64, 80, 96, 128, 256)
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_CPU = torch.device("cpu")


def _rows(t: torch.Tensor, dtype: torch.dtype, ndim: int) -> bool:
    """A CPU tensor of `dtype` and `ndim` dimensions whose last dimension is contiguous."""
    return t.dtype is dtype and t.is_cpu and t.dim() == ndim and t.stride(-1) == 1


def _heads(t: torch.Tensor, dtype: torch.dtype, tokens: int, head_dim: int) -> bool:
    """[tokens, heads, head_dim] with each token's heads contiguous (rows may be strided)."""
    return _rows(t, dtype, 3) and t.shape[0] == tokens and t.shape[2] == head_dim and t.stride(1) == head_dim


def _dense(t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    return t.dtype is dtype and t.is_cpu and t.shape == shape and t.is_contiguous()


def _check_bounds(
    block_ids: torch.Tensor,
    block_offsets: torch.Tensor,
    query_start: torch.Tensor,
    query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    cache_shape: torch.Size,
    tokens: int,
) -> None:
    """The values the kernel indexes with, for the sequences it attends (query_lens > 0): the
    C++ code trusts them, and a bad one reads outside the tensors rather than failing."""
    offsets = block_offsets.long()
    if int(offsets[0]) != 0 or bool((offsets[1:] < offsets[:-1]).any()) or int(offsets[-1]) > block_ids.numel():
        fail("block_offsets", f"must rise from 0 to at most the {block_ids.numel()} block ids")
    ids = block_ids[: int(offsets[-1])]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= cache_shape[0]):
        fail("block_ids", f"block id outside the cache of {cache_shape[0]} blocks")
    live = query_lens > 0
    need = (seq_lens.long() + cache_shape[1] - 1) // cache_shape[1]
    if bool((live & (offsets[1:] - offsets[:-1] < need)).any()):
        fail("block_offsets", "a row holds fewer blocks than its sequence's seq_lens needs")
    if bool((live & ((query_lens > seq_lens) | (query_start < 0) | (query_start + query_lens > tokens))).any()):
        fail("query_lens", f"query rows outside q's {tokens} tokens or longer than their sequence")


class CpuKernels:
    """The kernels of one library variant ("native" or "portable", see kernels.cpu_library)."""

    def __init__(self, variant: str = "native") -> None:
        self.variant = variant
        lib = load(variant)
        self._fns = {
            (name, dtype): getattr(lib, f"llmserve_{name}_{suffix}")
            for name in ("paged_attention", "rms_norm", "rotary", "store_kv", "silu_and_mul", "logits_stats")
            for dtype, suffix in _SUFFIX.items()
        }

    def paged_attention(
        self,
        q: torch.Tensor,  # [tokens, heads, head_dim]
        k_cache: torch.Tensor,  # [blocks, block_size, kv_heads, head_dim]
        v_cache: torch.Tensor,
        block_ids: torch.Tensor,  # int32 [total]: the tables' rows, one after another
        block_offsets: torch.Tensor,  # int32 [seqs + 1]: row i starts at block_ids[block_offsets[i]]
        query_start: torch.Tensor,  # int32 [seqs]: first query row of each sequence
        query_lens: torch.Tensor,  # int32 [seqs]: its query rows; 0 skips the sequence
        seq_lens: torch.Tensor,  # int32 [seqs]: tokens in the cache after this step
        scale: float,
        out: torch.Tensor | None = None,
        window: int = 0,
        softcap: float = 0.0,
        bounds_checked: bool = False,
    ) -> torch.Tensor:
        """Causal attention of each sequence's last q_len positions, read from the paged cache.

        Sequence i's queries are rows query_start[i] .. query_start[i] + query_lens[i] - 1 of q,
        at positions seq_lens[i] - query_lens[i] .. seq_lens[i] - 1: any mix of decodes, prefill
        chunks and prefix-cache hits. Its keys live in the blocks of its row of the ragged tables
        (common/block_tables.py), at least ceil(seq_lens[i] / block_size) long. Rows of skipped
        sequences are left as they are in `out`. head_dim one of ATTENTION_HEAD_DIMS; any block
        size. `window` > 0: a query sees only its last `window` positions (itself included);
        `softcap` > 0: scores (after `scale`) become softcap * tanh(score / softcap).

        `bounds_checked`: the caller has checked the tables against the cache and the query rows
        against q (the worker checks each plan once, not every layer).
        """
        dtype = q.dtype
        tokens, num_heads, head_dim = q.shape if q.dim() == 3 else (0, 0, 0)
        num_seqs = block_offsets.shape[0] - 1 if block_offsets.dim() == 1 else -1
        num_kv_heads = k_cache.shape[2] if k_cache.dim() == 4 else 0
        if out is None:
            out = torch.empty(tokens, num_heads, head_dim, dtype=dtype)
        i32 = torch.int32
        if not (
            dtype in _SUFFIX
            and _heads(q, dtype, tokens, head_dim)
            and _heads(out, dtype, tokens, head_dim)
            and out.shape[1] == num_heads
            and head_dim in ATTENTION_HEAD_DIMS
            and num_kv_heads
            and num_heads % num_kv_heads == 0
            and _dense(k_cache, dtype, k_cache.shape)
            and k_cache.shape[3] == head_dim
            and _dense(v_cache, dtype, k_cache.shape)
            and k_cache.shape[1] & (k_cache.shape[1] - 1) == 0
            and _dense(block_ids, i32, (block_ids.numel(),))
            and _dense(block_offsets, i32, (num_seqs + 1,))
            and _dense(query_start, i32, (num_seqs,))
            and _dense(query_lens, i32, (num_seqs,))
            and _dense(seq_lens, i32, (num_seqs,))
        ):
            self._explain_attention(
                q, k_cache, v_cache, block_ids, block_offsets, query_start, query_lens, seq_lens, out
            )
        if num_seqs and tokens:
            if not bounds_checked:
                _check_bounds(block_ids, block_offsets, query_start, query_lens, seq_lens, k_cache.shape, tokens)
            status = self._fns["paged_attention", dtype](
                q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_ids.data_ptr(),
                block_offsets.data_ptr(), query_start.data_ptr(), query_lens.data_ptr(), seq_lens.data_ptr(),
                num_seqs, num_heads, num_kv_heads, head_dim, k_cache.shape[1], scale, window, softcap,
                out.data_ptr(), out.stride(0), torch.get_num_threads(),
            )  # fmt: skip
            if status != 0:
                fail("q", f"no kernel for head_dim {head_dim}")
        return out

    @staticmethod
    def _explain_attention(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_ids: torch.Tensor,
        block_offsets: torch.Tensor,
        query_start: torch.Tensor,
        query_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        check_tensor("q", q, 3, CPU_DTYPES, device=_CPU)
        tokens, num_heads, head_dim = q.shape
        if q.stride(1) != head_dim:
            fail("q", f"heads of a token must be contiguous (stride {head_dim}), got strides {q.stride()}")
        if head_dim not in ATTENTION_HEAD_DIMS:
            fail("q", f"head_dim must be one of {', '.join(map(str, ATTENTION_HEAD_DIMS))}, got {head_dim}")
        num_kv_heads = k_cache.shape[2] if k_cache.dim() == 4 else 0
        check_cache(k_cache, v_cache, num_kv_heads, head_dim, q.dtype)
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if not c.is_contiguous() or c.device != _CPU:
                fail(name, "must be a contiguous CPU tensor")
        if num_heads % num_kv_heads:
            fail("q", f"{num_heads} query heads cannot be grouped over {num_kv_heads} KV heads")
        num_seqs = max(block_offsets.numel() - 1, 0)  # an empty block_offsets fails as one of shape (1,)
        check_block_tables(block_ids, block_offsets, num_seqs, _CPU)
        for name, t in (("query_start", query_start), ("query_lens", query_lens), ("seq_lens", seq_lens)):
            check_tensor(name, t, 1, (torch.int32,), device=_CPU)
            check_shape(name, t, (num_seqs,))
        check_tensor("out", out, 3, (q.dtype,), device=_CPU)
        check_shape("out", out, (tokens, num_heads, head_dim))
        if out.stride(1) != head_dim:
            fail("out", f"heads of a token must be contiguous, got strides {out.stride()}")

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [tokens, hidden]; returns (normed, new residual).

        With `residual`, the sum x + residual is written into `residual` itself (in place) and
        that tensor is returned as the new residual; without, the new residual is x.
        """
        dtype = x.dtype
        if not (
            dtype in _SUFFIX
            and _rows(x, dtype, 2)
            and _dense(weight, dtype, (x.shape[1],))
            and (residual is None or (_rows(residual, dtype, 2) and residual.shape == x.shape))
        ):
            check_tensor("x", x, 2, CPU_DTYPES, device=_CPU)
            check_tensor("weight", weight, 1, (x.dtype,), device=_CPU)
            check_shape("weight", weight, (x.shape[1],))
            if residual is not None:
                check_tensor("residual", residual, 2, (x.dtype,), device=_CPU)
                check_shape("residual", residual, tuple(x.shape))
        tokens, hidden = x.shape
        out = torch.empty(tokens, hidden, dtype=dtype)
        if tokens:
            self._fns["rms_norm", dtype](
                x.data_ptr(),
                x.stride(0),
                None if residual is None else residual.data_ptr(),
                0 if residual is None else residual.stride(0),
                weight.data_ptr(),
                eps,
                out.data_ptr(),
                hidden,
                tokens,
                hidden,
                torch.get_num_threads(),
            )
        return out, (x if residual is None else residual)

    def rotary(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        bounds_checked: bool = False,
    ) -> None:
        """Neox-style rotary embedding of q [tokens, heads, d] and k [tokens, kv_heads, d], in
        place, rounding like the model's torch path; cos/sin [max_positions, d / 2] in q's dtype.

        `bounds_checked`: the caller has checked every position against the tables (the worker
        checks each plan once, not every layer)."""
        dtype = q.dtype
        tokens, num_heads, head_dim = q.shape if q.dim() == 3 else (0, 0, 0)
        if not (
            dtype in _SUFFIX
            and head_dim % 2 == 0
            and _heads(q, dtype, tokens, head_dim)
            and _heads(k, dtype, tokens, head_dim)
            and _dense(positions, torch.int64, (tokens,))
            and _dense(cos, dtype, cos.shape)
            and cos.dim() == 2
            and cos.shape[1] == head_dim // 2
            and _dense(sin, dtype, cos.shape)
        ):
            self._explain_rotary(q, k, positions, cos, sin)
        if tokens and not bounds_checked and bool(((positions < 0) | (positions >= cos.shape[0])).any()):
            fail("positions", f"outside the table of {cos.shape[0]} positions")
        if tokens:
            self._fns["rotary", dtype](
                q.data_ptr(),
                q.stride(0),
                num_heads,
                k.data_ptr(),
                k.stride(0),
                k.shape[1],
                head_dim,
                positions.data_ptr(),
                cos.data_ptr(),
                sin.data_ptr(),
                tokens,
                torch.get_num_threads(),
            )

    @staticmethod
    def _explain_rotary(
        q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        check_tensor("q", q, 3, CPU_DTYPES, device=_CPU)
        tokens, _, head_dim = q.shape
        check_tensor("k", k, 3, (q.dtype,), device=_CPU)
        if k.shape[0] != tokens or k.shape[2] != head_dim:
            fail("k", f"expected [{tokens}, kv_heads, {head_dim}], got {tuple(k.shape)}")
        for name, t in (("q", q), ("k", k)):
            if t.stride(1) != head_dim:
                fail(name, f"heads of a token must be contiguous, got strides {t.stride()}")
        if head_dim % 2:
            fail("q", f"head_dim must be even, got {head_dim}")
        check_tensor("positions", positions, 1, (torch.int64,), device=_CPU)
        check_shape("positions", positions, (tokens,))
        if not positions.is_contiguous():
            fail("positions", "must be contiguous")
        for name, t in (("cos", cos), ("sin", sin)):
            check_tensor(name, t, 2, (q.dtype,), device=_CPU)
            if t.shape[1] != head_dim // 2 or not t.is_contiguous():
                fail(name, f"expected a contiguous [max_positions, {head_dim // 2}] table, got {tuple(t.shape)}")
        if cos.shape != sin.shape:
            fail("sin", f"shape {tuple(sin.shape)} differs from cos {tuple(cos.shape)}")

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        bounds_checked: bool = False,
    ) -> None:
        """key/value [tokens, kv_heads, d] into the caches at slot_mapping (int64, -1 = skip).

        `bounds_checked`: the caller has checked every slot against the cache."""
        dtype = key.dtype
        tokens, num_kv_heads, head_dim = key.shape if key.dim() == 3 else (0, 0, 0)
        if not (
            dtype in _SUFFIX
            and _heads(key, dtype, tokens, head_dim)
            and _heads(value, dtype, tokens, head_dim)
            and value.shape == key.shape
            and k_cache.dim() == 4
            and k_cache.shape[2:] == key.shape[1:]
            and _dense(k_cache, dtype, k_cache.shape)
            and _dense(v_cache, dtype, k_cache.shape)
            and _dense(slot_mapping, torch.int64, (tokens,))
        ):
            check_tensor("key", key, 3, CPU_DTYPES, device=_CPU)
            check_tensor("value", value, 3, (key.dtype,), device=_CPU)
            check_shape("value", value, tuple(key.shape))
            for name, t in (("key", key), ("value", value)):
                if t.stride(1) != head_dim:
                    fail(name, f"heads of a token must be contiguous, got strides {t.stride()}")
            check_cache(k_cache, v_cache, num_kv_heads, head_dim, key.dtype)
            for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
                if not c.is_contiguous() or c.device != _CPU:
                    fail(name, "must be a contiguous CPU tensor")
            check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,), device=_CPU)
            check_shape("slot_mapping", slot_mapping, (tokens,))
            if not slot_mapping.is_contiguous():
                fail("slot_mapping", "must be contiguous")
        slots = k_cache.shape[0] * k_cache.shape[1]
        if tokens and not bounds_checked and int(slot_mapping.max()) >= slots:
            fail("slot_mapping", f"slot outside the cache of {slots} slots")
        if tokens:
            self._fns["store_kv", dtype](
                key.data_ptr(),
                key.stride(0),
                value.data_ptr(),
                value.stride(0),
                k_cache.data_ptr(),
                v_cache.data_ptr(),
                slot_mapping.data_ptr(),
                tokens,
                num_kv_heads * head_dim,
                torch.get_num_threads(),
            )

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, 2 * d] -> [tokens, d]: silu(gate) * up."""
        dtype = x.dtype
        if not (dtype in _SUFFIX and _rows(x, dtype, 2) and x.shape[1] % 2 == 0):
            check_tensor("x", x, 2, CPU_DTYPES, device=_CPU)
            fail("x", f"last dimension must be even (gate | up), got {x.shape[1]}")
        tokens, width = x.shape
        d = width // 2
        out = torch.empty(tokens, d, dtype=dtype)
        if tokens:
            self._fns["silu_and_mul", dtype](
                x.data_ptr(), x.stride(0), out.data_ptr(), d, tokens, d, torch.get_num_threads()
            )
        return out

    def logits_stats(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [rows, vocab] -> (int64 argmax [rows], float32 logsumexp [rows]).

        The argmax is the first index of the row's maximum, as torch.argmax gives it; a token's
        log-probability is then logits[r, t] - logsumexp[r].
        """
        check_tensor("logits", logits, 2, CPU_DTYPES, device=_CPU)
        rows, vocab = logits.shape
        if vocab == 0:
            fail("logits", "empty vocabulary")
        argmax = torch.empty(rows, dtype=torch.int64)
        lse = torch.empty(rows, dtype=torch.float32)
        if rows:
            self._fns["logits_stats", logits.dtype](
                logits.data_ptr(),
                logits.stride(0),
                rows,
                vocab,
                argmax.data_ptr(),
                lse.data_ptr(),
                torch.get_num_threads(),
            )
        return argmax, lse


_default: dict[str, CpuKernels] = {}


def cpu_kernels(variant: str = "native") -> CpuKernels:
    """The process's kernels of `variant` (the library is built and loaded once)."""
    kernels = _default.get(variant)
    if kernels is None:
        kernels = _default[variant] = CpuKernels(variant)
    return kernels
