"""Compile every kernel for a Hopper GPU (sm_90) down to a cubin, without a GPU.

Run by tests/test_kernels_compile.py in a process of its own, because the test session runs
the kernels in the interpreter, and interpreted kernels cannot be compiled. Prints one JSON
object: kernel case -> "ok" or the compiler's error.
"""

from __future__ import annotations

import inspect
import json
import os

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.activation import _silu_and_mul_kernel
from kernels.kv_store import _store_kv_kernel
from kernels.paged_attention import _decode_merge_kernel, _decode_partial_kernel
from kernels.prefill_attention import NUM_WARPS_GPU, TILE_M_GPU, _prefill_kernel
from kernels.rms_norm import _rms_norm_kernel
from kernels.rotary import _rotary_kernel

INT32_POINTERS = {"block_tables_ptr", "seq_lens_ptr", "query_start_ptr"}
INT64_POINTERS = {"slot_ptr", "positions_ptr"}
FP32_POINTERS = {"acc_ptr", "max_ptr", "sum_ptr"}


# Launch options the wrappers use on a GPU, where they differ from Triton's defaults.
NUM_WARPS = {"_prefill_kernel": NUM_WARPS_GPU}


def signature(fn: triton.JITFunction, dtype: str, constexprs: dict[str, object]) -> ASTSource:
    params = list(inspect.signature(fn.fn).parameters)
    missing = {p for p in params if p.isupper()} - set(constexprs)
    if missing:
        raise ValueError(f"constexprs missing for {fn.fn.__name__}: {missing}")
    sig = {}
    for p in params:
        if p in constexprs:
            sig[p] = "constexpr"
        elif p in INT32_POINTERS:
            sig[p] = "*i32"
        elif p in INT64_POINTERS:
            sig[p] = "*i64"
        elif p in FP32_POINTERS:
            sig[p] = "*fp32"
        elif p.endswith("_ptr"):
            sig[p] = f"*{dtype}"
        elif p in ("scale", "eps"):
            sig[p] = "fp32"
        else:
            sig[p] = "i32"
    return ASTSource(fn=fn, signature=sig, constexprs={(params.index(k),): v for k, v in constexprs.items()})


def cases() -> list[tuple[str, triton.JITFunction, str, dict[str, object]]]:
    out = []
    for dtype, native, precision in (("bf16", True, "tf32"), ("fp32", False, "ieee")):
        attn = dict(HEAD_DIM=80, HEAD_DIM_PAD=128, BLOCK_SIZE=16, NATIVE_DOT=native, DOT_PRECISION=precision)
        out += [
            ("decode", _decode_partial_kernel, dtype, dict(GROUP=4, GROUP_PAD=16, TILE=64, **attn)),
            ("prefill", _prefill_kernel, dtype, dict(GROUP=4, TILE_M=TILE_M_GPU, TILE_N=64, **attn)),
        ]
    out += [
        ("decode_merge", _decode_merge_kernel, "bf16", dict(SPLITS_PAD=16, HEAD_DIM=128, HEAD_DIM_PAD=128)),
        ("store_kv", _store_kv_kernel, "bf16", dict(HEAD_DIM=80, HEAD_DIM_PAD=128, BLOCK_SIZE=16)),
        ("rms_norm", _rms_norm_kernel, "bf16", dict(HAS_RESIDUAL=True, BLOCK=1024)),
        ("rotary", _rotary_kernel, "bf16", dict(HALF=64, HALF_PAD=64, HEADS_PAD=32, KV_HEADS_PAD=8)),
        ("silu_and_mul", _silu_and_mul_kernel, "bf16", dict(BLOCK=1024)),
    ]
    return out


def main() -> None:
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    results = {}
    for name, fn, dtype, constexprs in cases():
        key = f"{name}-{dtype}"
        try:
            options = {"num_warps": NUM_WARPS.get(fn.fn.__name__, 4)}
            compiled = triton.compile(signature(fn, dtype, constexprs), target=GPUTarget("cuda", 90, 32), options=options)
            ok = bool(compiled.asm["cubin"]) and ".target sm_90" in compiled.asm["ptx"]
            results[key] = "ok" if ok else "no sm_90 cubin"
        except Exception as error:  # noqa: BLE001 (reported, not raised: one bad kernel must not hide the rest)
            results[key] = f"{type(error).__name__}: {error}"[:2000]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
