"""Multi-LoRA shrink/expand kernels against the torch reference, the reference against a per-token
loop, the tensor-parallel layouts, and the wrapper's refusals.

Without CUDA the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET), where every
dot is widened to float32. Tolerances against the float32 reference added to the float32 base
output (absolute and relative, values of order 1): float32 1e-4, float16 2e-3, bfloat16 1.6e-2
(the last rounding to the model dtype dominates). Rows of slot -1 must come back bit-identical.
"""

from __future__ import annotations

import pytest
import torch

from kernels.lora import BLOCK_K, BLOCK_N, MAX_BLOCK_R, lora_reference, lora_segments, lora_shrink_expand, shrink_tiles
from tests.conftest import KERNEL_DEVICE

DEVICE = torch.device(KERNEL_DEVICE)
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def make_adapters(
    ranks: list[int], max_rank: int, in_features: int, out_features: int, seed: int, rslora: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 slots with true ranks `ranks` zero-padded to max_rank, and lora_alpha = 16 scales."""
    g = torch.Generator().manual_seed(seed)
    num_slots = len(ranks)
    a = torch.randn(num_slots, max_rank, in_features, generator=g) / in_features**0.5
    b = torch.randn(num_slots, out_features, max_rank, generator=g) / max_rank**0.5
    for s, r in enumerate(ranks):
        a[s, r:] = 0.0
        b[s, :, r:] = 0.0
    scales = torch.tensor([16.0 / (r**0.5 if rslora else r) for r in ranks], dtype=torch.float32)
    return a, b, scales


def sequence_slots(lengths: list[int], slots: list[int]) -> torch.Tensor:
    """int32 [sum(lengths)]: each sequence's tokens contiguous, its slot repeated."""
    return torch.cat([torch.full((n,), s, dtype=torch.int32) for n, s in zip(lengths, slots)])


def run_kernel(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    token_slots: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kernel's out, base out, float32 expected) with every input cast to `dtype` on DEVICE."""
    x, a, b = (t.to(dtype) for t in (x, a, b))
    g = torch.Generator().manual_seed(x.shape[0] + b.shape[1])
    base = torch.randn(x.shape[0], b.shape[1], generator=g).to(dtype)
    expected = base.float() + lora_reference(x, a, b, token_slots, scales)
    out = base.clone().to(DEVICE)  # .to is no copy on the CPU
    lora_shrink_expand(x.to(DEVICE), a.to(DEVICE), b.to(DEVICE), token_slots.to(DEVICE), scales.to(DEVICE), out)
    return out.cpu(), base, expected


# (true ranks per slot, max_rank, in, out, sequence lengths, their slots). Slot 1 is never used in
# the mixed cases; features are not multiples of BLOCK_K / BLOCK_N; 300 inputs give 2 shrink splits.
SHAPES = {
    "r8-pad16-T37": ([8, 8, 8], 16, 300, 200, [5, 1, 9, 3, 12, 7], [2, -1, 0, 2, -1, 0]),
    "r8-16-64-T37": ([8, 16, 64, 16], 64, 130, 100, [1, 4, 1, 10, 6, 15], [3, 0, -1, 2, 0, 3]),
    "r64-T1": ([64, 64], 64, 96, 72, [1], [1]),
    "r128-32-T5": ([128, 32], 128, 40, 24, [2, 3], [1, 0]),  # two rank tiles of MAX_BLOCK_R
}


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_kernel_matches_reference(dtype: torch.dtype, shape: str) -> None:
    ranks, max_rank, in_features, out_features, lengths, slots = SHAPES[shape]
    a, b, scales = make_adapters(ranks, max_rank, in_features, out_features, seed=len(shape))
    token_slots = sequence_slots(lengths, slots)
    x = torch.randn(token_slots.numel(), in_features, generator=torch.Generator().manual_seed(7))
    got, base, expected = run_kernel(x, a, b, token_slots, scales, dtype)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)
    untouched = token_slots == -1
    assert torch.equal(got[untouched], base[untouched])  # the base model's rows are never written
    assert (expected[~untouched] - base[~untouched].float()).abs().mean() > 0.1  # the delta is not ~0


def test_shapes_cover_the_tiles() -> None:
    """The grid above exercises split-K, partial feature tiles and more than one rank tile."""
    assert shrink_tiles(7, 16, 300)[1] == 2 and 300 % BLOCK_K and 200 % BLOCK_N and 72 % BLOCK_N
    assert shrink_tiles(4, 128, 40) == (MAX_BLOCK_R, 1, BLOCK_K) and 128 // MAX_BLOCK_R == 2


def test_reference_matches_a_per_token_loop() -> None:
    a, b, scales = make_adapters([2, 4, 3], 4, 6, 5, seed=3, rslora=True)
    token_slots = torch.tensor([1, 1, -1, 0, 2, 2, 2, 1, -1], dtype=torch.int32)
    x = torch.randn(token_slots.numel(), 6, generator=torch.Generator().manual_seed(4))
    expected = torch.zeros(token_slots.numel(), 5)
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0:
            expected[t] = float(scales[s]) * (b[s] @ (a[s] @ x[t]))
    torch.testing.assert_close(lora_reference(x, a, b, token_slots, scales), expected, atol=1e-6, rtol=1e-6)
    assert float(scales[1]) == 16.0 / 2.0  # rsLoRA: alpha / sqrt(r), r = 4


def test_segments_strided_rows_and_a_column_slice() -> None:
    """One sort serves two layers; x's rows and out's rows strided (out a column slice of a fused
    output, as q/k/v of a qkv projection): the columns beside it are never touched."""
    a, b, scales = make_adapters([8, 16], 16, 70, 40, seed=5)
    token_slots = sequence_slots([3, 6, 4, 8], [1, -1, 0, 1])
    tokens = token_slots.numel()
    wide_x = torch.randn(tokens, 90, generator=torch.Generator().manual_seed(6))
    x = wide_x[:, 10:80]
    fused = torch.randn(tokens, 100, generator=torch.Generator().manual_seed(8))
    before = fused.clone()
    expected = before[:, 30:70] + lora_reference(x, a, b, token_slots, scales)
    d_slots = token_slots.to(DEVICE)
    segments = lora_segments(d_slots, 2)
    out = fused.to(DEVICE)
    for _ in range(2):  # the same segments twice: the delta twice
        lora_shrink_expand(
            x.to(DEVICE), a.to(DEVICE), b.to(DEVICE), d_slots, scales.to(DEVICE), out[:, 30:70], segments
        )
    expected += lora_reference(x, a, b, token_slots, scales)
    torch.testing.assert_close(out[:, 30:70].cpu(), expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(out[:, :30].cpu(), before[:, :30]) and torch.equal(out[:, 70:].cpu(), before[:, 70:])


def test_tensor_parallel_shards() -> None:
    """Column-parallel: a shard of B gives that shard of the delta. Row-parallel: shards of x and A
    with full B, summed over ranks (the layer's all-reduce), give the whole delta."""
    tp = 2
    a, b, scales = make_adapters([8, 4, 8], 8, 64, 48, seed=9)
    token_slots = sequence_slots([2, 5, 3], [2, 0, -1])
    x = torch.randn(token_slots.numel(), 64, generator=torch.Generator().manual_seed(10))
    full = lora_reference(x, a, b, token_slots, scales)
    d = [t.to(DEVICE) for t in (x, a, b, token_slots, scales)]
    rows = torch.zeros(x.shape[0], 48).to(DEVICE)
    for rank in range(tp):
        cols = slice(rank * 24, (rank + 1) * 24)
        col_out = torch.zeros(x.shape[0], 24).to(DEVICE)
        lora_shrink_expand(d[0], d[1], d[2][:, cols].contiguous(), d[3], d[4], col_out)
        torch.testing.assert_close(col_out.cpu(), full[:, cols], atol=1e-5, rtol=1e-5)
        ins = slice(rank * 32, (rank + 1) * 32)
        partial = torch.zeros(x.shape[0], 48).to(DEVICE)
        lora_shrink_expand(d[0][:, ins], d[1][:, :, ins], d[2], d[3], d[4], partial)
        rows += partial
    torch.testing.assert_close(rows.cpu(), full, atol=1e-5, rtol=1e-5)


def test_empty_step_and_base_only_step() -> None:
    a, b, scales = make_adapters([8], 8, 32, 16, seed=11)
    d = [t.to(DEVICE) for t in (a, b, scales)]
    empty = torch.empty(0, 16).to(DEVICE)
    lora_shrink_expand(
        torch.empty(0, 32).to(DEVICE), d[0], d[1], torch.empty(0, dtype=torch.int32).to(DEVICE), d[2], empty
    )
    out = torch.randn(4, 16).to(DEVICE)
    before = out.clone()
    x = torch.randn(4, 32).to(DEVICE)
    lora_shrink_expand(x, d[0], d[1], torch.full((4,), -1, dtype=torch.int32).to(DEVICE), d[2], out)
    assert torch.equal(out, before)


def _args(**changes: object) -> dict[str, object]:
    args: dict[str, object] = dict(
        x=torch.zeros(5, 32),
        a_slots=torch.zeros(3, 8, 32),
        b_slots=torch.zeros(3, 16, 8),
        token_slots=torch.zeros(5, dtype=torch.int32),
        scales=torch.ones(3),
        out=torch.zeros(5, 16),
    )
    args.update(changes)
    return args


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(x=torch.zeros(5, 32, 1)), "x: expected 2 dimensions"),
        (dict(x=torch.zeros(5, 32, dtype=torch.int32)), "x: dtype"),
        (dict(x=torch.zeros(32, 5).t()), "x: the last dimension"),
        (dict(a_slots=torch.zeros(3, 8, 32, dtype=torch.float16)), "a_slots: dtype torch.float16"),
        (dict(a_slots=torch.zeros(3, 8, 30)), r"a_slots: expected \[num_slots, max_rank, 32\]"),
        (dict(a_slots=torch.zeros(0, 8, 32)), "a_slots: expected at least one slot"),
        (dict(a_slots=torch.zeros(3, 32, 8).transpose(1, 2)), "a_slots: the last dimension"),
        (dict(b_slots=torch.zeros(3, 16, 4)), r"b_slots: expected \[3, out_features, 8\]"),
        (dict(b_slots=torch.zeros(2, 16, 8)), r"b_slots: expected \[3, out_features, 8\]"),
        (dict(b_slots=torch.zeros(3, 8, 16).transpose(1, 2)), "b_slots: the last dimension"),
        (dict(token_slots=torch.zeros(5, dtype=torch.int64)), "token_slots: dtype torch.int64"),
        (dict(token_slots=torch.zeros(4, dtype=torch.int32)), r"token_slots: expected shape \(5,\)"),
        (dict(token_slots=torch.zeros(5, dtype=torch.int32, device="meta")), "token_slots: on meta"),
        (dict(scales=torch.ones(3, dtype=torch.float16)), "scales: dtype torch.float16"),
        (dict(scales=torch.ones(4)), r"scales: expected shape \(3,\)"),
        (dict(out=torch.zeros(5, 17)), r"out: expected shape \(5, 16\)"),
        (dict(out=torch.zeros(5, 16, dtype=torch.float16)), "out: dtype torch.float16"),
        (dict(out=torch.zeros(16, 5).t()), "out: the last dimension"),
        (dict(segments=lora_segments(torch.zeros(5, dtype=torch.int32), 2)), "segments: made for 2 slots"),
        (dict(segments=lora_segments(torch.zeros(40, dtype=torch.int32), 3)), "segments: made for 40 tokens, not 5"),
    ],
    ids=[
        "x-3d",
        "x-int",
        "x-strided",
        "a-dtype",
        "a-features",
        "a-no-slots",
        "a-strided",
        "b-rank",
        "b-slots",
        "b-strided",
        "slots-int64",
        "slots-length",
        "slots-device",
        "scales-dtype",
        "scales-length",
        "out-features",
        "out-dtype",
        "out-strided",
        "segments-slots",
        "segments-tokens",
    ],
)
def test_wrapper_refuses(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        lora_shrink_expand(**_args(**changes))  # type: ignore[arg-type]
