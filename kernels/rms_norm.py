"""RMSNorm with an optional residual add fused in: one read of x, one write of each output.

    residual given:  s = x + residual;  returns (rmsnorm(s) * weight, s)
    otherwise:       returns (rmsnorm(x) * weight, x)

Computed like the reference: in float32, the normalised value cast to the input dtype before
the weight multiplies it. One program per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import FLOAT_DTYPES, check_shape, check_tensor, pow2


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    new_residual_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_nr,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # row * stride passes 2^31 at ~262k tokens of hidden 8192
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = x + tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        # The sum is rounded to the model dtype, as the reference's add would round it.
        x_round = x.to(new_residual_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * stride_nr + offs, x_round, mask=mask)
        x = x_round.to(tl.float32)
    variance = tl.sum(x * x, 0) / hidden
    normed = (x * tl.rsqrt(variance + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [tokens, hidden]; returns (normed, new residual); the new residual is x without `residual`."""
    check_tensor("x", x, 2, FLOAT_DTYPES)
    tokens, hidden = x.shape
    check_tensor("weight", weight, 1, (x.dtype,), device=x.device)
    check_shape("weight", weight, (hidden,))
    if residual is not None:
        check_tensor("residual", residual, 2, (x.dtype,), device=x.device)
        check_shape("residual", residual, (tokens, hidden))
    out = torch.empty_like(x)
    new_residual = torch.empty_like(x) if residual is not None else x
    if tokens:
        _rms_norm_kernel[(tokens,)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            new_residual,
            x.stride(0),
            (residual if residual is not None else x).stride(0),
            out.stride(0),
            new_residual.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=pow2(hidden),
        )
    return out, new_residual


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), x
