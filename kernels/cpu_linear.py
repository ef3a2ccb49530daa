"""A bfloat16 linear weight packed once for the CPU's GEMMs, and the GEMM that reads it.

Where the CPU has AVX512-BF16 but no AMX and the C++ kernels build, the weight goes into our
own panel layout (`kernels/cpu/linear.cpp`); elsewhere oneDNN keeps it in the blocked layout
its GEMMs read (`mkldnn._reorder_linear_weight`): with AMX, its tile GEMMs are far ahead.
Ours ran SmolLM2's linears 1.37x faster than oneDNN's at a decode's 96 rows, and no slower at
a prompt's 2,048 (Zen 5, docs/benchmarks.md); and each of its rows is the same sum whatever
the batch, where oneDNN's single-row kernel rounds otherwise than its kernels for several rows.

A [gate | up] weight can be packed in halves (`halves=True`, our kernel only): then
`activated` gives silu(gate) * up straight from the GEMM's sums, with the same bits as the GEMM
and then `cpu_ops.silu_and_mul`, without storing gate and up.
"""

from __future__ import annotations

import functools

import torch

from kernels.checks import check_tensor, fail
from kernels.cpu_library import CpuKernelsUnavailable, cpu_flags, load

# The M oneDNN's packed layout is tuned for; any M works (a typical decode batch).
ONEDNN_BATCH_HINT = 64
_CPU = torch.device("cpu")


@functools.cache
def own_kernel() -> bool:
    """Whether linear.cpp's GEMM runs here: the native C++ kernels build and the CPU has
    AVX512-BF16 and no AMX."""
    if "amx_bf16" in cpu_flags():
        return False
    try:
        lib = load("native")
    except CpuKernelsUnavailable:
        return False
    probe = torch.zeros(lib.llmserve_packed_linear_elems(2, 2), dtype=torch.bfloat16)
    return (
        lib.llmserve_pack_linear_bf16(torch.zeros(2, 2, dtype=torch.bfloat16).data_ptr(), 2, 2, 2, 0, probe.data_ptr())
        == 0
    )


@functools.cache
def onednn_packs() -> bool:
    """Whether oneDNN can hold a bfloat16 weight packed (AVX-512 or AVX-NE-CONVERT)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:  # oneDNN refuses, with a RuntimeError, on CPUs without those instructions
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), ONEDNN_BATCH_HINT)
    except RuntimeError:
        return False
    return True


def _ours(in_features: int) -> bool:
    """Whether our GEMM takes a weight of this many input features (it reads them in pairs)."""
    return own_kernel() and in_features % 2 == 0


def can_pack(weight: torch.Tensor, halves: bool = False) -> bool:
    """A bfloat16 CPU weight that one of the two GEMMs can hold packed (in halves: ours, with
    halves of whole 32-column runs)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return False
    n, k = weight.shape
    if halves:
        return _ours(k) and n % 64 == 0
    return _ours(k) or onednn_packs()


class PackedLinear:
    """weight [out_features, in_features], packed; calling it gives x @ weight^T (+ bias)."""

    def __init__(self, weight: torch.Tensor, halves: bool = False) -> None:
        if not can_pack(weight, halves):
            what = "in halves " if halves else ""
            fail("weight", f"cannot pack a {weight.dtype} {tuple(weight.shape)} weight {what}on {weight.device}")
        self.out_features, self.in_features = weight.shape
        self.own = _ours(self.in_features)
        self.halves = halves
        w = weight.detach()
        if self.own:
            lib = load("native")
            self._gemm = lib.llmserve_linear_bf16
            self.data = torch.empty(lib.llmserve_packed_linear_elems(*w.shape), dtype=torch.bfloat16)
            if w.stride(1) != 1:
                w = w.contiguous()
            lib.llmserve_pack_linear_bf16(w.data_ptr(), w.stride(0), *w.shape, int(halves), self.data.data_ptr())
        else:
            self.data = torch.ops.mkldnn._reorder_linear_weight(w, ONEDNN_BATCH_HINT)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not self.own:
            return torch.ops.mkldnn._linear_pointwise(x, self.data, bias, "none", [], "")
        return self._gemm_call(x, bias, activate=False)

    def activated(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """silu(gate) * up of x @ weight^T (+ bias) = [gate | up]: [..., out_features / 2]."""
        if not self.halves:
            fail("weight", "silu(gate) * up needs a weight packed in halves")
        return self._gemm_call(x, bias, activate=True)

    def _gemm_call(self, x: torch.Tensor, bias: torch.Tensor | None, activate: bool) -> torch.Tensor:
        k, n = self.in_features, self.out_features
        width = n // 2 if activate else n
        if not (x.dtype == torch.bfloat16 and x.device == _CPU and x.dim() >= 1 and x.shape[-1] == k):
            check_tensor("x", x, x.dim(), (torch.bfloat16,), device=_CPU)
            fail("x", f"last dimension must be in_features {k}, got {tuple(x.shape)}")
        lead = x.shape[:-1]
        rows = x.reshape(-1, k)
        if rows.shape[0] and rows.stride(1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], width, dtype=torch.bfloat16)
        b = None
        if bias is not None:
            if bias.shape != (n,):
                fail("bias", f"must be [{n}], got {tuple(bias.shape)}")
            b = bias.detach().float().contiguous()
        if rows.shape[0]:
            self._gemm(
                rows.data_ptr(),
                rows.stride(0),
                rows.shape[0],
                k,
                self.data.data_ptr(),
                n,
                None if b is None else b.data_ptr(),
                out.data_ptr(),
                width,
                int(self.halves),
                int(activate),
                torch.get_num_threads(),
            )
        return out.view(*lead, width)
