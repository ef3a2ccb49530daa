"""The CPU kernels (kernels/cpu/*.cpp) against torch references, in both library variants.

"native" is what a worker runs here (AVX-512 and AVX512-BF16 on this machine); "portable"
compiles the same sources without intrinsics, which is what a CPU without AVX-512 runs.
Tolerances: float32 within 1e-5 of the float32 reference; bfloat16 within one rounding of
the output (the references compute in float32), and bit for bit where the kernel promises to
round like the model's torch path (RMSNorm, rotary, SiLU-and-mul up to a float ulp).
"""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from common.block_tables import BlockTables
from kernels.activation import silu_and_mul_reference
from kernels.cpu_library import VARIANTS, CpuKernelsUnavailable, build, compiler
from kernels.cpu_ops import ATTENTION_HEAD_DIMS, CpuKernels, cpu_kernels
from kernels.kv_store import store_kv_reference
from kernels.prefill_attention import paged_prefill_attention_reference
from kernels.rms_norm import rms_norm_reference
from worker_svc.layers.attention import PagedAttentionBackend, TorchPagedAttention
from worker_svc.layers.cpu_attention import CpuPagedAttention
from worker_svc.layers.rotary import _rotate

DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture(scope="module", params=VARIANTS)
def k(request: pytest.FixtureRequest) -> CpuKernels:
    return cpu_kernels(request.param)


def _paged_batch(
    q_lens: list[int],
    contexts: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """q (a strided view, as the model's qkv split gives it), caches with NaN in every slot no
    sequence owns, ragged tables of shuffled blocks (every other row holding a spare block
    past the ones its tokens fill, as a row may), and the query offsets."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(contexts, q_lens)]
    need = sum(-(-s // block_size) for s in seq_lens)
    num_blocks = need + len(seq_lens) + 3
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    order = torch.randperm(num_blocks, generator=g)
    rows, used = [], 0
    for i, n in enumerate(seq_lens):
        blocks = order[used : used + -(-n // block_size) + i % 2]
        used += len(blocks)
        rows.append(blocks.tolist())
        slots = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:n]
        k_cache.view(-1, kv_heads, head_dim)[slots] = torch.randn(n, kv_heads, head_dim, generator=g).to(dtype)
        v_cache.view(-1, kv_heads, head_dim)[slots] = torch.randn(n, kv_heads, head_dim, generator=g).to(dtype)
    tokens = sum(q_lens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    starts = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.tensor(q_lens).cumsum(0)
    ids, offsets = _ragged(BlockTables.from_rows(rows))
    return q, k_cache, v_cache, ids, offsets, starts, torch.tensor(seq_lens, dtype=torch.int32)


def _ragged(tables: BlockTables) -> tuple[torch.Tensor, torch.Tensor]:
    """(block_ids, block_offsets): the two tensors the kernels take for a table."""
    return torch.from_numpy(tables.ids), torch.from_numpy(tables.offsets)


def _attention_tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1.6e-2


# Decodes of lengths 1, bs - 1, bs, bs + 1 and a long one, prefill chunks with and without
# context, in one batch.
MIXED_Q = [1, 1, 1, 1, 1, 37, 5, 20, 9]
MIXED_C = [0, 15, 16, 17, 700, 0, 17, 33, 3]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (8, 2), (4, 4), (5, 1), (12, 4), (16, 2)])
def test_paged_attention_mixed_batch(k: CpuKernels, dtype: torch.dtype, heads: int, kv_heads: int) -> None:
    q, kc, vc, ids, offsets, starts, seq_lens = _paged_batch(MIXED_Q, MIXED_C, heads, kv_heads, 64, 16, dtype)
    q_lens = torch.tensor(MIXED_Q, dtype=torch.int32)
    out = k.paged_attention(q, kc, vc, ids, offsets, starts[:-1].contiguous(), q_lens, seq_lens, 0.125)
    ref = paged_prefill_attention_reference(q, kc, vc, ids, offsets, starts, seq_lens, 0.125)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), ref, atol=_attention_tolerance(dtype), rtol=_attention_tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("window", "softcap"), [(13, 0.0), (0, 1.5), (21, 1.5), (1, 0.0)])
def test_paged_attention_sliding_window_and_softcap(
    k: CpuKernels, dtype: torch.dtype, window: int, softcap: float
) -> None:
    # Windows that start mid-block and mid-chunk, shorter and longer than the query chunks.
    q, kc, vc, ids, offsets, starts, seq_lens = _paged_batch(MIXED_Q, MIXED_C, 8, 2, 64, 16, dtype, seed=2)
    q.mul_(3)  # scores large enough for the cap to bite
    q_lens = torch.tensor(MIXED_Q, dtype=torch.int32)
    out = k.paged_attention(
        q, kc, vc, ids, offsets, starts[:-1].contiguous(), q_lens, seq_lens, 0.125, window=window, softcap=softcap
    )
    ref = paged_prefill_attention_reference(q, kc, vc, ids, offsets, starts, seq_lens, 0.125, window, softcap)
    plain = paged_prefill_attention_reference(q, kc, vc, ids, offsets, starts, seq_lens, 0.125)
    assert (ref - plain).abs().max() > 0.05
    tol = _attention_tolerance(dtype)
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("head_dim", ATTENTION_HEAD_DIMS)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_paged_attention_head_and_block_sizes(k: CpuKernels, head_dim: int, block_size: int) -> None:
    q_lens, contexts = [1, 1, 3, 1], [0, 40, 21, 95]
    for dtype in DTYPES:
        q, kc, vc, ids, offsets, starts, seq_lens = _paged_batch(
            q_lens, contexts, 6, 2, head_dim, block_size, dtype, seed=1
        )
        lens = torch.tensor(q_lens, dtype=torch.int32)
        out = k.paged_attention(q, kc, vc, ids, offsets, starts[:-1].contiguous(), lens, seq_lens, head_dim**-0.5)
        ref = paged_prefill_attention_reference(q, kc, vc, ids, offsets, starts, seq_lens, head_dim**-0.5)
        tol = _attention_tolerance(dtype)
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_paged_attention_skips_sequences_without_rows(k: CpuKernels) -> None:
    # Rows of a sequence with query_lens 0 are the caller's (the worker attends fresh prompts
    # with SDPA and writes them into the same output).
    q_lens = [1, 4, 1]
    q, kc, vc, ids, offsets, starts, seq_lens = _paged_batch(q_lens, [10, 0, 30], 4, 2, 64, 16, torch.float32)
    out = torch.full(q.shape, 7.0)
    lens = torch.tensor([1, 0, 1], dtype=torch.int32)
    k.paged_attention(q, kc, vc, ids, offsets, starts[:-1].contiguous(), lens, seq_lens, 0.125, out)
    ref = paged_prefill_attention_reference(q, kc, vc, ids, offsets, starts, seq_lens, 0.125)
    assert torch.equal(out[1:5], torch.full((4, 4, 64), 7.0))
    torch.testing.assert_close(out[[0, 5]], ref[[0, 5]], atol=1e-5, rtol=1e-5)


def test_paged_attention_is_the_same_for_a_sequence_in_any_batch(k: CpuKernels) -> None:
    # Work is split per sequence, never across them: a row's result does not depend on its
    # neighbours (what makes greedy output independent of batching).
    contexts = [5, 90, 33, 16, 200, 1]
    q, kc, vc, ids, offsets, starts, seq_lens = _paged_batch([1] * 6, contexts, 9, 3, 64, 16, torch.bfloat16)
    ones = torch.ones(6, dtype=torch.int32)
    full = k.paged_attention(q, kc, vc, ids, offsets, starts[:-1].contiguous(), ones, seq_lens, 0.125)
    tables = BlockTables(offsets.numpy(), ids.numpy())
    for i in range(6):
        alone_ids, alone_offsets = _ragged(tables.take(np.array([i])))
        zero = torch.zeros(1, dtype=torch.int32)
        alone = k.paged_attention(
            q[i : i + 1], kc, vc, alone_ids, alone_offsets, zero, ones[:1], seq_lens[i : i + 1].contiguous(), 0.125
        )
        assert torch.equal(alone[0], full[i])


@pytest.mark.parametrize("rows", [2, 5, 7, 8, 17])
def test_a_verification_query_rounds_each_row_as_its_decode(k: CpuKernels, rows: int) -> None:
    # Speculative decoding verifies K drafts as one query of K + 1 rows; in bfloat16 each row
    # must be the very bits a decode at that position gives, or greedy outputs with and without
    # drafts part at near ties. (Prompts, queries of 33 rows or more, may round otherwise.)
    q, kc, vc, ids, offsets, starts, seq_lens = _paged_batch([rows], [45], 9, 3, 64, 16, torch.bfloat16)
    one = torch.ones(1, dtype=torch.int32)
    query = k.paged_attention(
        q, kc, vc, ids, offsets, starts[:1], torch.tensor([rows], dtype=torch.int32), seq_lens, 0.125
    )
    for r in range(rows):
        at = torch.tensor([45 + r + 1], dtype=torch.int32)
        decode = k.paged_attention(q[r : r + 1], kc, vc, ids, offsets, starts[:1], one, at, 0.125)
        assert torch.equal(decode[0], query[r]), r


# Rows of 1, 3 and 40 blocks of 16: the long one a decode, or a chunk after 600 cached tokens.
LONG_ROWS = {"long decode": [(8, 1), (30, 10), (632, 1)], "long chunk": [(5, 4), (39, 1), (600, 33)]}


class _LongRow:
    """A step of (context, query tokens) sequences whose K/V are also kept whole, so that the
    reference reads no table; the cache's blocks are shuffled, every slot no one owns is NaN."""

    def __init__(self, pairs: list[tuple[int, int]], dtype: torch.dtype, heads: int = 8, kv_heads: int = 2) -> None:
        g, bs, d = torch.Generator().manual_seed(11), 16, 64
        self.pairs, self.scale = pairs, d**-0.5
        lens = [c + n for c, n in pairs]
        order = torch.randperm(sum(-(-n // bs) for n in lens) + 5, generator=g).tolist()
        self.tables = BlockTables.from_rows([[order.pop() for _ in range(-(-n // bs))] for n in lens])
        assert self.tables.lens.tolist() == [1, 3, 40]
        self.kc = torch.full((self.tables.ids.size + 5, bs, kv_heads, d), float("nan"), dtype=dtype)
        self.vc = self.kc.clone()
        self.keys = [torch.randn(n, kv_heads, d, generator=g).to(dtype) for n in lens]
        self.values = [torch.randn(n, kv_heads, d, generator=g).to(dtype) for n in lens]
        slots = []  # of every cached token, sequence by sequence
        for i, n in enumerate(lens):
            pos = np.arange(n)
            slots.append(self.tables.row(i)[pos // bs].astype(np.int64) * bs + pos % bs)
            self.kc.view(-1, kv_heads, d)[slots[-1]] = self.keys[i]
            self.vc.view(-1, kv_heads, d)[slots[-1]] = self.values[i]
        self.slots = np.concatenate([s[c:] for s, (c, _) in zip(slots, pairs)])  # this step's tokens
        self.k = torch.cat([kk[c:] for kk, (c, _) in zip(self.keys, pairs)])
        self.v = torch.cat([vv[c:] for vv, (c, _) in zip(self.values, pairs)])
        self.q = torch.randn(len(self.slots), heads, d, generator=g).to(dtype)
        self.context = np.array([c for c, _ in pairs], np.int32)
        self.query = np.array([n for _, n in pairs], np.int32)

    def reference(self) -> torch.Tensor:
        """float32 causal attention of each sequence's queries over its whole K/V."""
        out, start = [], 0
        for (ctx, n), keys, values in zip(self.pairs, self.keys, self.values):
            group = self.q.shape[1] // keys.shape[1]
            kf, vf = keys.float().repeat_interleave(group, 1), values.float().repeat_interleave(group, 1)
            scores = torch.einsum("qhd,khd->hqk", self.q[start : start + n].float(), kf) * self.scale
            later = torch.arange(ctx + n)[None, :] > torch.arange(ctx, ctx + n)[:, None]  # [n, all]
            out.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(later, float("-inf")).softmax(-1), vf))
            start += n
        return torch.cat(out)


@pytest.mark.parametrize("layout", list(LONG_ROWS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_long_row_beside_short_ones(k: CpuKernels, layout: str, dtype: torch.dtype) -> None:
    step, tol = _LongRow(LONG_ROWS[layout], dtype), _attention_tolerance(dtype)
    want = step.reference()
    ids, offsets = _ragged(step.tables)
    starts = torch.from_numpy(np.concatenate([[0], np.cumsum(step.query)[:-1]]).astype(np.int32))
    seq_lens = torch.from_numpy(step.context + step.query)
    out = k.paged_attention(
        step.q, step.kc, step.vc, ids, offsets, starts, torch.from_numpy(step.query), seq_lens, step.scale
    )
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)
    # The worker's backends over the same plan arrays: the C++ one with the chunks in the
    # kernel and through SDPA, and the torch reference (which multiplies its padding by zero:
    # there NaN would stay, so that one runs on a cache without it).
    heads, kv_heads, d = step.q.shape[1], step.kc.shape[2], step.q.shape[2]
    backends: list[PagedAttentionBackend] = [
        CpuPagedAttention(heads, kv_heads, d, step.scale, k, sdpa_prefills=False),
        CpuPagedAttention(heads, kv_heads, d, step.scale, k, sdpa_prefills=True),
        TorchPagedAttention(heads, kv_heads, d, step.scale),
    ]
    for backend in backends:
        meta = backend.build_metadata(step.query, step.context, step.tables, step.slots, 16, torch.device("cpu"))
        kc, vc = (c.clone() if backend.name == "cpu" else c.nan_to_num(0.0) for c in (step.kc, step.vc))
        got = backend.forward(step.q, step.k, step.v, kc, vc, meta)
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 100])
def test_rms_norm(k: CpuKernels, dtype: torch.dtype, hidden: int) -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, hidden, generator=g).to(dtype)
    weight = torch.randn(hidden, generator=g).to(dtype)
    residual = torch.randn(9, hidden, generator=g).to(dtype)
    expected, expected_sum = rms_norm_reference(x, weight, 1e-5, residual)
    given = residual.clone()
    out, new_residual = k.rms_norm(x, weight, 1e-5, given)
    assert new_residual is given  # the sum is written in place
    assert torch.equal(new_residual, expected_sum)
    plain, same = k.rms_norm(x, weight, 1e-5)
    assert same is x
    if dtype == torch.bfloat16:  # rounded where the reference rounds: the same bits
        assert torch.equal(out, expected) and torch.equal(plain, rms_norm_reference(x, weight, 1e-5)[0])
    else:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(plain, rms_norm_reference(x, weight, 1e-5)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_rounds_like_the_model(k: CpuKernels, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    tokens, heads, kv_heads, d = 11, 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    q = qkv[:, : heads * d].view(tokens, heads, d)
    key = qkv[:, heads * d : (heads + kv_heads) * d].view(tokens, kv_heads, d)
    angles = torch.arange(300)[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2) / d))[None, :]
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    positions = torch.randint(0, 300, (tokens,), generator=g)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    want_q, want_k = _rotate(q.clone(), c, s), _rotate(key.clone(), c, s)
    k.rotary(q, key, positions, cos, sin)  # in place, through the strided views
    assert torch.equal(q, want_q) and torch.equal(key, want_k)


def test_rotary_refuses_positions_outside_the_table(k: CpuKernels) -> None:
    q, key = torch.zeros(2, 1, 16), torch.zeros(2, 1, 16)
    cos = sin = torch.zeros(8, 8)
    with pytest.raises(ValueError, match="positions"):
        k.rotary(q, key, torch.tensor([0, 8]), cos, sin)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv(k: CpuKernels, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(4)
    key = torch.randn(6, 3, 64, generator=g).to(dtype)
    value = torch.randn(6, 3, 64, generator=g).to(dtype)
    caches = [torch.zeros(4, 16, 3, 64, dtype=dtype) for _ in range(4)]
    slots = torch.tensor([5, -1, 17, 63, 0, -1])
    k.store_kv(key, value, caches[0], caches[1], slots)
    store_kv_reference(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(ValueError, match="slot_mapping"):
        k.store_kv(key, value, caches[0], caches[1], torch.tensor([0, 1, 2, 3, 4, 64]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [3072, 2 * 37])
def test_silu_and_mul(k: CpuKernels, dtype: torch.dtype, width: int) -> None:
    x = (torch.randn(7, width, generator=torch.Generator().manual_seed(5)) * 6).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0]).to(dtype)  # exp over- and underflow
    out, ref = k.silu_and_mul(x), silu_and_mul_reference(x)
    if dtype == torch.bfloat16:
        # A refined reciprocal instead of a division: the silu can round the other way at a
        # tie, one step of the intermediate, so at most two steps of the output apart.
        step = torch.finfo(torch.bfloat16).eps * ref.float().abs().clamp(min=1e-30)
        assert bool(((out.float() - ref.float()).abs() <= 2 * step).all())
        assert (out != ref).float().mean() < 0.01
    else:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_logits_stats(k: CpuKernels, dtype: torch.dtype) -> None:
    logits = (torch.randn(5, 1000 + 7, generator=torch.Generator().manual_seed(6)) * 4).to(dtype)
    logits[1, 10] = logits[1, 900] = 50.0  # a tie: the first index, as torch.argmax gives it
    logits[2, :] = -float("inf")
    logits[2, 1006] = 1.0  # the last lane of a partial vector
    argmax, lse = k.logits_stats(logits)
    assert torch.equal(argmax, logits.float().argmax(-1)) and int(argmax[1]) == 10
    torch.testing.assert_close(lse, torch.logsumexp(logits.float(), -1), atol=1e-5, rtol=1e-5)


def test_bad_arguments_are_named(k: CpuKernels) -> None:
    with pytest.raises(ValueError, match="^x: dtype"):
        k.rms_norm(torch.zeros(2, 8, dtype=torch.float16), torch.ones(8, dtype=torch.float16), 1e-5)
    with pytest.raises(ValueError, match="^weight"):
        k.rms_norm(torch.zeros(2, 8), torch.ones(9), 1e-5)
    q, kc, vc, ids, offsets, starts, seq_lens = _paged_batch([1], [4], 4, 2, 64, 16, torch.float32)
    one = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="^v_cache"):
        k.paged_attention(q, kc, vc.to(torch.bfloat16), ids, offsets, starts[:1], one, seq_lens, 0.1)
    with pytest.raises(ValueError, match="^q: head_dim"):
        k.paged_attention(torch.zeros(1, 4, 48), kc, vc, ids, offsets, starts[:1], one, seq_lens, 0.1)
    with pytest.raises(ValueError, match="^query_lens"):
        k.paged_attention(q, kc, vc, ids, offsets, starts[:1], one.long(), seq_lens, 0.1)
    with pytest.raises(ValueError, match="^block_offsets: expected shape"):
        k.paged_attention(q, kc, vc, ids, offsets[:0], starts[:1], one, seq_lens, 0.1)
    # The values the C++ code indexes with: a row too short for its tokens, a block outside
    # the cache, query rows past q's.
    with pytest.raises(ValueError, match="^block_offsets: a row holds fewer blocks"):
        k.paged_attention(q, kc, vc, ids, offsets, starts[:1], one, seq_lens + 16, 0.1)
    with pytest.raises(ValueError, match="^block_ids: block id outside"):
        k.paged_attention(q, kc, vc, ids + kc.shape[0], offsets, starts[:1], one, seq_lens, 0.1)
    with pytest.raises(ValueError, match="^query_lens: query rows outside"):
        k.paged_attention(q, kc, vc, ids, offsets, starts[:1] + 1, one, seq_lens, 0.1)
    with pytest.raises(ValueError, match="^x: last dimension"):
        k.silu_and_mul(torch.zeros(2, 7))


def test_library_is_cached_by_sources_and_machine(
    tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMSERVE_CACHE", str(tmp_path))
    first = build("native")
    assert first.is_file() and str(first).startswith(str(tmp_path))
    stamp = first.stat().st_mtime_ns
    assert build("native") == first and first.stat().st_mtime_ns == stamp  # reused, not rebuilt


def test_no_compiler_is_a_clear_error_and_the_worker_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(CpuKernelsUnavailable, match="no C\\+\\+ compiler"):
        compiler()


def test_worker_without_a_compiler_uses_the_torch_kernels(tmp_path: pytest.TempPathFactory) -> None:
    # A fresh process (no library loaded yet), a cache with nothing in it, and no compiler.
    code = (
        "import torch\n"
        "from worker_svc.step.loader import resolve_attention_backend\n"
        "print(resolve_attention_backend('auto', torch.device('cpu'), torch.bfloat16, 64))\n"
    )
    env = {"PATH": "/nonexistent", "CXX": "/nonexistent/c++", "LLMSERVE_CACHE": str(tmp_path), "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip().splitlines()[-1] == "torch"
    assert "cpu_kernels_unavailable" in out.stdout + out.stderr


def test_auto_picks_the_cpu_kernels_only_where_they_apply() -> None:
    from worker_svc.step.loader import resolve_attention_backend

    cpu = torch.device("cpu")
    assert resolve_attention_backend("auto", cpu, torch.bfloat16, 64) == "cpu"
    assert resolve_attention_backend("auto", cpu, torch.float32, 128) == "cpu"
    assert resolve_attention_backend("auto", cpu, torch.float16, 64) == "torch"
    assert resolve_attention_backend("auto", cpu, torch.float32, 16) == "torch"
    assert resolve_attention_backend("torch", cpu, torch.float32, 64) == "torch"


def test_exp_of_the_kernels_is_accurate(k: CpuKernels) -> None:
    # silu exercises the vector exp over its whole range; compare in float32 where the
    # reciprocal error is far below the tolerance.
    x = torch.linspace(-80, 80, 16 * 101).view(1, -1)
    gate_up = torch.cat([x, torch.ones_like(x)], dim=1)
    out = k.silu_and_mul(gate_up)
    want = torch.tensor([v / (1 + math.exp(-v)) for v in x[0].tolist()])
    torch.testing.assert_close(out[0], want, atol=1e-6, rtol=2e-6)
