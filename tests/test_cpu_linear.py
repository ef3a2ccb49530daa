"""The bfloat16 GEMM of packed linear weights on the CPU (kernels/cpu_linear.py, kernels/cpu/linear.cpp).

Checked against float64 products rounded to bfloat16, row for row against itself in other
batches (a row's bits must not depend on the rest of the batch: speculative verification rows
must round as their decodes), and against oneDNN's packed GEMM, which it replaces.
"""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_library import load
from kernels.cpu_linear import PackedLinear, can_pack, onednn_packs, own_kernel

needs_own = pytest.mark.skipif(not own_kernel(), reason="the CPU has no AVX512-BF16 (oneDNN runs the linears)")

# (out_features, in_features): SmolLM2's projections, a ragged last panel, a narrow head.
SHAPES = [(960, 576), (576, 1536), (3072, 576), (100, 64), (130, 96)]


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.double() @ w.double().T
    if bias is not None:
        y = y + bias.double()
    return y


def _within_bf16(y: torch.Tensor, ref: torch.Tensor, k: int) -> None:
    # One bfloat16 rounding of the result (2^-8 relative) plus float32 sums of k products.
    tol = ref.abs() * 2.0**-8 + 1e-6 * k * 4
    err = (y.double() - ref).abs()
    assert bool((err <= tol).all()), f"max error {float(err.max()):.3g} over {float((err / tol).max()):.2f}x the bound"


@needs_own
@pytest.mark.parametrize("out_features,in_features", SHAPES)
@pytest.mark.parametrize("rows", [1, 5, 6, 13, 96])
def test_matches_the_float64_product(rows: int, out_features: int, in_features: int) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    w = (torch.randn(out_features, in_features, generator=g) * 0.05).bfloat16()
    packed = PackedLinear(w)
    assert packed.own
    y = packed(x)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
    _within_bf16(y, _reference(x, w), in_features)


@needs_own
def test_bias_is_added_before_rounding() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 576, generator=g).bfloat16()
    w = (torch.randn(130, 576, generator=g) * 0.05).bfloat16()
    bias = torch.randn(130, generator=g).bfloat16()
    y = PackedLinear(w)(x, bias)
    _within_bf16(y, _reference(x, w, bias), 576)
    # The sum is rounded once: the same as the float32 sum plus the bias, then bfloat16.
    plain = PackedLinear(w)(x).float()
    assert not torch.equal(y, PackedLinear(w)(x))
    assert (y.float() - (plain + bias.float())).abs().max() <= (plain + bias.float()).abs().max() * 2**-7


@needs_own
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_row_has_the_same_bits_in_any_batch_and_split(threads: int) -> None:
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(960, 576, generator=g) * 0.05).bfloat16()
    packed = PackedLinear(w)
    batch = torch.randn(97, 576, generator=g).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        whole = packed(batch)
        for start, stop in [(0, 1), (5, 6), (10, 17), (40, 96), (90, 97)]:
            assert torch.equal(packed(batch[start:stop]), whole[start:stop]), (start, stop)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(packed(batch), whole)


@needs_own
def test_leading_dims_strided_rows_and_no_rows() -> None:
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(100, 64, generator=g) * 0.05).bfloat16()
    packed = PackedLinear(w)
    x = torch.randn(2, 3, 64, generator=g).bfloat16()
    y = packed(x)
    assert y.shape == (2, 3, 100)
    assert torch.equal(y.reshape(6, 100), packed(x.reshape(6, 64)))
    wide = torch.randn(4, 128, generator=g).bfloat16()
    assert torch.equal(packed(wide[:, :64]), packed(wide[:, :64].contiguous()))  # rows 128 apart
    assert packed(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 100)


@needs_own
def test_agrees_with_onednn_to_an_ulp() -> None:
    if not onednn_packs():
        pytest.skip("oneDNN cannot pack bfloat16 weights here")
    g = torch.Generator().manual_seed(7)
    x = torch.randn(96, 1536, generator=g).bfloat16()
    w = (torch.randn(576, 1536, generator=g) * 0.05).bfloat16()
    ours = PackedLinear(w)(x).float()
    onednn = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, 64), None, "none", [], "")
    diff = (ours - onednn.float()).abs()
    assert float((diff > 0).float().mean()) < 0.01  # the same sums, a few rounded the other way
    assert bool((diff <= onednn.float().abs() * 2**-7).all())


def test_bad_input_is_refused_by_name() -> None:
    w = torch.randn(64, 64).bfloat16()
    if not can_pack(w):
        pytest.skip("no packed bfloat16 GEMM on this CPU")
    packed = PackedLinear(w)
    if not packed.own:
        pytest.skip("oneDNN runs the linears here")
    with pytest.raises(ValueError, match="x: last dimension must be in_features 64"):
        packed(torch.randn(3, 32).bfloat16())
    with pytest.raises(ValueError, match="x:"):
        packed(torch.randn(3, 64))  # float32
    with pytest.raises(ValueError, match="bias: must be"):
        packed(torch.randn(3, 64).bfloat16(), torch.zeros(3))
    with pytest.raises(ValueError, match="weight: cannot pack"):
        PackedLinear(torch.randn(8, 8))


@needs_own
def test_odd_in_features_fall_back_to_onednn() -> None:
    if not onednn_packs():
        pytest.skip("oneDNN cannot pack bfloat16 weights here")
    w = (torch.randn(32, 63) * 0.05).bfloat16()
    packed = PackedLinear(w)
    assert not packed.own
    x = torch.randn(4, 63).bfloat16()
    _within_bf16(packed(x), _reference(x, w), 63)


def test_the_portable_build_has_no_gemm() -> None:
    # Without AVX512-BF16 the entry points say so, and the worker keeps oneDNN.
    lib = load("portable")
    w = torch.zeros(2, 2, dtype=torch.bfloat16)
    out = torch.zeros(lib.llmserve_packed_linear_elems(2, 2), dtype=torch.bfloat16)
    assert lib.llmserve_pack_linear_bf16(w.data_ptr(), 2, 2, 2, 0, out.data_ptr()) == -1


@needs_own
@pytest.mark.parametrize("rows", [1, 7, 96])
@pytest.mark.parametrize("with_bias", [False, True])
def test_halves_give_the_gemm_then_silu_bits(rows: int, with_bias: bool) -> None:
    from kernels.cpu_ops import cpu_kernels

    g = torch.Generator().manual_seed(rows)
    half = 96
    w = (torch.randn(2 * half, 576, generator=g) * 0.05).bfloat16()
    bias = torch.randn(2 * half, generator=g).bfloat16() if with_bias else None
    x = torch.randn(rows, 576, generator=g).bfloat16()
    plain, halves = PackedLinear(w), PackedLinear(w, halves=True)
    gate_up = plain(x, bias)
    # Unactivated, the halves packing gives [gate | up] as the plain one does, bit for bit.
    assert torch.equal(halves(x, bias), gate_up)
    # Activated: the same bits as the GEMM, then the SiLU kernel.
    assert torch.equal(halves.activated(x, bias), cpu_kernels().silu_and_mul(gate_up))
    with pytest.raises(ValueError, match="needs a weight packed in halves"):
        plain.activated(x)
    with pytest.raises(ValueError, match="in halves"):
        PackedLinear(w[:100], halves=True)  # halves of 50 rows: not whole 32-column runs


class _Step:
    active = frozenset({0})


class _AddOne:
    """A LoRA update stand-in that adds 1 to every output of the step."""

    def __init__(self, active: bool) -> None:
        self.step = _Step() if active else type("Idle", (), {"active": frozenset()})()

    def add(self, x: torch.Tensor, out: torch.Tensor) -> None:
        out += 1


@needs_own
def test_gate_up_runs_the_silu_on_the_gemm_unless_a_lora_adds_to_the_step() -> None:
    from kernels.cpu_ops import cpu_kernels
    from worker_svc.device.parallel import SINGLE
    from worker_svc.layers.tp_layers import MergedColumnParallelLinear

    g = torch.Generator().manual_seed(2)
    layer = MergedColumnParallelLinear(576, 160, SINGLE, dtype=torch.bfloat16)
    weight = (torch.randn(320, 576, generator=g) * 0.05).bfloat16()
    layer.weight.data.copy_(weight)
    layer.pack_for_cpu()
    assert layer.packed is not None and layer.packed.halves
    x = torch.randn(9, 576, generator=g).bfloat16()
    gate_up = PackedLinear(weight)(x)
    silu = cpu_kernels().silu_and_mul
    fused = layer.silu_and_mul(x)
    assert fused is not None and torch.equal(fused, silu(gate_up))
    layer.lora = _AddOne(active=False)  # adapters loaded, none in this step
    fused = layer.silu_and_mul(x)
    assert fused is not None and torch.equal(fused, silu(gate_up))
    layer.lora = _AddOne(active=True)
    assert layer.silu_and_mul(x) is None  # the MLP then adds the update before its activation
    assert torch.equal(layer(x), gate_up + 1)
