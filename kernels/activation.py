"""SiLU-and-mul, the gate of a SwiGLU MLP: [tokens, 2 * d] -> [tokens, d], silu(gate) * up.

Fusing it saves writing and re-reading the activated gate. One program per (token, column tile).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import FLOAT_DTYPES, check_tensor, fail

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row * stride passes 2^31 at ~75k tokens of a 14336-wide MLP
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + offs, mask=mask, other=0.0).to(tl.float32)
    # Rounded to the model dtype between the two products, as the reference computes it.
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    check_tensor("x", x, 2, FLOAT_DTYPES)
    tokens, width = x.shape
    if width % 2:
        fail("x", f"last dimension must be even (gate and up halves), got {width}")
    d = width // 2
    out = torch.empty(tokens, d, dtype=x.dtype, device=x.device)
    if tokens:
        _silu_and_mul_kernel[(tokens, triton.cdiv(d, BLOCK))](x, out, x.stride(0), out.stride(0), d, BLOCK=BLOCK)
    return out


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
