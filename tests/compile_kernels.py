"""Compile kernels for a Hopper GPU (sm_90) down to a cubin, without a GPU.

Run by tests/test_kernels_compile.py in a process of its own, because the test session runs
the kernels in the interpreter, and interpreted kernels cannot be compiled. Prints one JSON
object: kernel case -> {"compiled": "ok" or the compiler's error, "int32_index_products":
the Triton IR lines that multiply a batch-sized index by a stride in int32}.
benchmarks/kernel_resources.py compiles `worker_cases` with the same machinery.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.activation import BLOCK as SILU_BLOCK
from kernels.activation import _silu_and_mul_kernel
from kernels.checks import dot_precision, pow2
from kernels.fused_moe import BLOCK_M as MOE_BLOCK_M
from kernels.fused_moe import _grouped_gemm_kernel, moe_block_ms
from kernels.fused_moe import _num_warps as moe_num_warps
from kernels.kv_store import _store_kv_kernel
from kernels.lora import BLOCK_K as LORA_BLOCK_K
from kernels.lora import BLOCK_M as LORA_BLOCK_M
from kernels.lora import BLOCK_N as LORA_BLOCK_N
from kernels.lora import MAX_BLOCK_R as LORA_MAX_BLOCK_R
from kernels.lora import _lora_expand_kernel, _lora_shrink_kernel
from kernels.paged_attention import _decode_merge_kernel, _decode_partial_kernel, decode_launch
from kernels.prefill_attention import _prefill_kernel, prefill_launch
from kernels.rms_norm import _rms_norm_kernel
from kernels.rotary import _rotary_kernel
from kernels.token_mask import BLOCK as TOKEN_MASK_BLOCK
from kernels.token_mask import _token_bitmask_kernel

# Triton 3.9 warns unless this is set; 1 keeps its (and the worker's) default, FMA contraction.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

TARGET = GPUTarget("cuda", 90, 32)
INT32_POINTERS = {"block_ids_ptr", "block_offsets_ptr", "seq_lens_ptr", "query_start_ptr"}
INT64_POINTERS = {"slot_ptr", "positions_ptr", "sorted_ids_ptr", "block_expert_ptr", "block_slot_ptr"}
FP32_POINTERS = {"acc_ptr", "max_ptr", "sum_ptr", "weights_ptr", "scales_ptr"}
BITMASK_POINTERS = {"masks_ptr"}  # int32 words of packed bits: data, not indices
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# Values that grow with the batch: the program id along grid axis 0 (a token, a sequence or a
# query tile in every kernel) and whatever is read from these index arrays. Multiplied by a
# stride they pass 2^31 long before the index itself does, so that product must be int64.
INDEX_POINTERS = INT32_POINTERS | INT64_POINTERS


@dataclass(frozen=True)
class Case:
    """One kernel specialisation, launched the way its wrapper launches it on a GPU."""

    name: str
    kernel: triton.JITFunction
    dtype: str  # the model dtype: bf16, fp16 or fp32
    constexprs: dict[str, object] = field(hash=False)
    num_warps: int = 4
    num_stages: int = 3
    head_dim: int | None = None
    # Integer arguments that are multiples of 16 in the worker's launches. Triton specialises
    # such arguments (and 16-byte aligned pointers) when it compiles for a launch, and the
    # hint decides whether loads are vectorised and can become cp.async: an offline compile
    # without it measures a different kernel.
    aligned: frozenset[str] = frozenset()

    @property
    def key(self) -> str:
        return f"{self.name}-{self.dtype}"


def strides(kernel: triton.JITFunction, *but: str) -> frozenset[str]:
    """The kernel's stride arguments, all multiples of head_dim or hidden size, except `but`."""
    return frozenset(p for p in inspect.signature(kernel.fn).parameters if p.startswith("stride") and p not in but)


def signature(
    fn: triton.JITFunction, dtype: str, constexprs: dict[str, object], aligned: frozenset[str] = frozenset()
) -> ASTSource:
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
        elif p in BITMASK_POINTERS:
            sig[p] = "*i32"
        elif p in FP32_POINTERS:
            sig[p] = "*fp32"
        elif p.endswith("_ptr"):
            sig[p] = f"*{dtype}"
        elif p in ("scale", "eps", "softcap"):
            sig[p] = "fp32"
        else:
            sig[p] = "i32"  # what Triton specialises a Python int below 2^31 to
    divisible = [p for p in params if p not in constexprs and (p.endswith("_ptr") or p in aligned)]
    return ASTSource(
        fn=fn,
        signature=sig,
        constexprs={(params.index(k),): v for k, v in constexprs.items()},
        attrs={(params.index(p),): [["tt.divisibility", 16]] for p in divisible},
    )


def compile_case(case: Case) -> triton.compiler.CompiledKernel:
    options = {"num_warps": case.num_warps, "num_stages": case.num_stages}
    source = signature(case.kernel, case.dtype, case.constexprs, case.aligned)
    return triton.compile(source, target=TARGET, options=options)


def attention_cases(
    head_dim: int, dtype: str, block_size: int = 16, group: int = 4, softcap: bool = False
) -> list[Case]:
    """The decode, merge and prefill launches of one layer shape, as the wrappers choose them."""
    torch_dtype = TORCH_DTYPES[dtype]
    native = dtype != "fp32"
    attn = dict(
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=pow2(head_dim, 16),
        BLOCK_SIZE=block_size,
        NATIVE_DOT=native,
        DOT_PRECISION=dot_precision(torch_dtype),
        SOFTCAP=softcap,
    )
    dec = decode_launch(head_dim, torch_dtype, group, on_gpu=True)
    pre = prefill_launch(head_dim, torch_dtype, on_gpu=True)
    return [
        Case(
            f"decode-d{head_dim}",
            _decode_partial_kernel,
            dtype,
            dict(GROUP=group, GROUP_PAD=dec.rows, TILE=dec.keys, **attn),
            dec.num_warps,
            dec.num_stages,
            head_dim,
            strides(_decode_partial_kernel),
        ),
        # 64 splits is the most default_num_splits asks for: the widest merge.
        Case(
            f"decode_merge-d{head_dim}",
            _decode_merge_kernel,
            dtype,
            dict(SPLITS_PAD=64, HEAD_DIM=head_dim, HEAD_DIM_PAD=pow2(head_dim, 16)),
            head_dim=head_dim,
            aligned=strides(_decode_merge_kernel),
        ),
        Case(
            f"prefill-d{head_dim}",
            _prefill_kernel,
            dtype,
            dict(GROUP=group, TILE_M=pre.rows, TILE_N=pre.keys, **attn),
            pre.num_warps,
            pre.num_stages,
            head_dim,
            strides(_prefill_kernel),
        ),
    ]


def layer_cases(head_dim: int, dtype: str, num_heads: int = 32, num_kv_heads: int = 8) -> list[Case]:
    """The per-token kernels whose tiles depend on the head size."""
    half = head_dim // 2
    return [
        Case(
            f"store_kv-d{head_dim}",
            _store_kv_kernel,
            dtype,
            dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=pow2(head_dim), BLOCK_SIZE=16),
            head_dim=head_dim,
            aligned=strides(_store_kv_kernel),
        ),
        # The cos/sin row is half a head: a multiple of 16 only from head_dim 64 on (not 80).
        Case(
            f"rotary-d{head_dim}-h{num_heads}",
            _rotary_kernel,
            dtype,
            dict(HALF=half, HALF_PAD=pow2(half), HEADS_PAD=pow2(num_heads), KV_HEADS_PAD=pow2(num_kv_heads)),
            head_dim=head_dim,
            aligned=strides(_rotary_kernel, *(() if half % 16 == 0 else ("stride_cos",))),
        ),
    ]


def hidden_cases(hidden: int, dtype: str) -> list[Case]:
    # Rows are contiguous: every stride is the hidden size or a multiple of it.
    aligned = strides(_rms_norm_kernel) | {"hidden"} if hidden % 16 == 0 else frozenset()
    return [
        Case(
            f"rms_norm-{hidden}{'-residual' * residual}",
            _rms_norm_kernel,
            dtype,
            dict(HAS_RESIDUAL=residual, BLOCK=pow2(hidden)),
            aligned=aligned,
        )
        for residual in (False, True)
    ]


def silu_case(dtype: str) -> Case:
    """Every model's intermediate size is a multiple of 16."""
    return Case(
        "silu_and_mul",
        _silu_and_mul_kernel,
        dtype,
        dict(BLOCK=SILU_BLOCK),
        aligned=strides(_silu_and_mul_kernel) | {"d"},
    )


def token_mask_case(dtype: str, vocab: int = 49152) -> Case:
    """Grammar masks over the logits' rows: a row's stride is the vocabulary (SmolLM2's 49152 is
    a multiple of 16, as is its 1536 words of mask)."""
    words = -(-vocab // 32)
    aligned = {"stride_logits", "vocab"} if vocab % 16 == 0 else set()
    aligned |= {"stride_masks"} if words % 16 == 0 else set()
    name = f"token_mask-v{vocab}"
    return Case(name, _token_bitmask_kernel, dtype, dict(BLOCK=TOKEN_MASK_BLOCK), aligned=frozenset(aligned))


def moe_cases(dtype: str, block_ms: tuple[int, ...] = moe_block_ms()) -> list[Case]:
    """The two grouped GEMMs of a mixture-of-experts block: gate/up (A rows per top_k pairs),
    then down with the routing weights, at each row tile a step can pick (fused_moe.moe_block_m)."""
    torch_dtype = TORCH_DTYPES[dtype]
    aligned = strides(_grouped_gemm_kernel) | {"k"}
    out = []
    for block_m in block_ms:
        common = dict(
            BLOCK_M=block_m,
            BLOCK_N=64,
            BLOCK_K=64,
            NATIVE_DOT=dtype != "fp32",
            DOT_PRECISION=dot_precision(torch_dtype),
        )
        suffix = "" if block_m == MOE_BLOCK_M else f"-m{block_m}"
        warps = moe_num_warps(block_m)
        out += [
            Case(
                f"moe_gate_up{suffix}",
                _grouped_gemm_kernel,
                dtype,
                dict(TOP_K=2, SCALE_ROWS=False, **common),
                num_warps=warps,
                aligned=aligned,
            ),
            Case(
                f"moe_down{suffix}",
                _grouped_gemm_kernel,
                dtype,
                dict(TOP_K=1, SCALE_ROWS=True, **common),
                num_warps=warps,
                aligned=aligned,
            ),
        ]
    return out


def lora_cases(dtype: str, hidden: int = 4096, rank: int = 64) -> list[Case]:
    """Multi-LoRA shrink (x @ A.T, split-K) and expand (+= P @ B.T) of a hidden-square layer.

    Feature counts and the strides they make are multiples of 16 at Llama-like widths, the rank
    (and the strides it is) when it is; the split stride (tokens x rank) is never specialised."""
    torch_dtype = TORCH_DTYPES[dtype]
    common = dict(
        BLOCK_M=LORA_BLOCK_M,
        BLOCK_R=min(pow2(rank, 16), LORA_MAX_BLOCK_R),
        NATIVE_DOT=dtype != "fp32",
        DOT_PRECISION=dot_precision(torch_dtype),
    )
    by_hidden = {"in_features", "out_features", "stride_xm", "stride_ar", "stride_om"} if hidden % 16 == 0 else set()
    by_rank = {"rank", "stride_accm", "stride_bn"} if rank % 16 == 0 else set()
    by_both = {"stride_as", "stride_bs"} if (hidden * rank) % 16 == 0 else set()
    aligned = frozenset(by_hidden | by_rank | by_both)  # names a kernel lacks are ignored
    name = f"h{hidden}-r{rank}"
    shrink = dict(BLOCK_K=LORA_BLOCK_K, **common)
    expand = dict(BLOCK_N=LORA_BLOCK_N, **common)
    return [
        Case(f"lora_shrink-{name}", _lora_shrink_kernel, dtype, shrink, aligned=aligned),
        Case(f"lora_expand-{name}", _lora_expand_kernel, dtype, expand, aligned=aligned),
    ]


def worker_cases(
    head_dims: tuple[int, ...], dtypes: tuple[str, ...], hiddens: tuple[int, ...], wide_groups: tuple[int, ...] = ()
) -> list[Case]:
    """Every kernel configuration a worker launches on a GPU for these model shapes.

    Query-head groups of up to 16 heads all pad to one 16-row decode tile; `wide_groups` adds
    decode launches for wider ones (multi-query models: 48 heads over one KV head pads to 64).
    """
    out = []
    for dtype in dtypes:
        for head_dim in head_dims:
            out += attention_cases(head_dim, dtype) + layer_cases(head_dim, dtype)
            for group in wide_groups:
                wide = attention_cases(head_dim, dtype, group=group)[0]
                out.append(dataclasses.replace(wide, name=f"{wide.name}-g{group}"))
        for hidden in hiddens:
            out += hidden_cases(hidden, dtype)
        out.append(silu_case(dtype))
        out += moe_cases(dtype)
        out.append(token_mask_case(dtype))
        out += lora_cases(dtype)
    return out


@triton.jit
def _planted_int32_product(x_ptr, stride_x, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """The bug the IR check looks for, planted: the check must report it, or it checks nothing."""
    row = tl.program_id(0)
    tl.store(x_ptr + row * stride_x + tl.arange(0, BLOCK), 0.0)


PLANTED = Case("planted_int32_product", _planted_int32_product, "fp32", dict(BLOCK=128))


def cases() -> list[Case]:
    """One of each kernel, at an unusual head size (80: padded to 128)."""
    out = []
    for dtype in ("bf16", "fp32"):
        out += [c for c in attention_cases(80, dtype) if not c.name.startswith("decode_merge")]
    out += [attention_cases(128, "bf16")[1], *layer_cases(80, "bf16")[:1], layer_cases(128, "bf16")[1]]
    out += [hidden_cases(1000, "bf16")[1], silu_case("bf16"), *moe_cases("bf16", (MOE_BLOCK_M,))]
    out += [token_mask_case("bf16", vocab=49155), token_mask_case("fp32")]
    out += [*lora_cases("bf16", hidden=1000, rank=8), *lora_cases("fp32")]
    return out


# ---- The int32 check on the Triton IR ----------------------------------------------------

_RESULT = re.compile(r"^\s*(%[\w.$-]+(?::\d+)?(?:\s*,\s*%[\w.$-]+)*)\s*=\s*([\w.]+)(.*)$")
_VALUE = re.compile(r"%[\w.$-]+")
_FUNC = re.compile(r"tt\.func\s+\w*\s*@\w+\((.*?)\)\s*(?:attributes|\{)", re.S)
_LOC = re.compile(r"\bloc\(.*$")


def _function_args(ttir: str, params: list[str]) -> dict[str, str]:
    """SSA name of each kernel argument -> its Python parameter name."""
    header = _FUNC.search(ttir)
    if header is None:
        raise ValueError("no tt.func in the IR")
    names = re.findall(r"(%[\w.$-]+)\s*:", header.group(1))
    non_constexpr = [p for p in params if not p.isupper()]
    for candidates in (params, non_constexpr):
        if len(candidates) == len(names):
            return dict(zip(names, candidates))
    raise ValueError(f"{len(names)} IR arguments for parameters {params}")


def _element_type(mlir_type: str) -> str:
    """i64 of `i64` and of `tensor<64x1xi64>`."""
    return re.sub(r"^tensor<(?:\d+x)*", "", mlir_type.strip()).rstrip(">")


def int32_index_products(ttir: str, params: list[str]) -> list[str]:
    """The `arith.muli` lines of the IR that multiply a batch-sized value by a stride in int32.

    A batch-sized value is one computed from the program id along axis 0 or from a value
    read out of an index array (INDEX_POINTERS); `x % constant` is bounded, not batch-sized.
    Values the parser cannot trace (loop and region arguments) count as batch-sized, so the
    check errs towards reporting. A stride is anything computed from a `stride_*` argument.
    """
    args = _function_args(ttir, params)
    strided = {v for v, p in args.items() if p.startswith("stride")}
    index_ptrs = {v for v, p in args.items() if p in INDEX_POINTERS}
    defined = set(args)
    constants: set[str] = set()
    batch: set[str] = set()
    found = []
    lines = [line for line in ttir.splitlines() if _RESULT.match(line)]
    for line in lines:
        m = _RESULT.match(line)
        assert m is not None
        defined.update(_VALUE.findall(m.group(1)))
    for line in lines:
        m = _RESULT.match(line)
        assert m is not None
        results = _VALUE.findall(m.group(1))  # `%11:3` (three results) is used as %11#0 .. %11#2
        op, rest = m.group(2), _LOC.sub("", m.group(3))
        operands = _VALUE.findall(rest.split(" : ")[0])
        untraced = any(v not in defined for v in operands)
        if op == "arith.constant":
            constants.update(results)
        elif op == "tt.get_program_id":
            if " x " in f"{rest} ":
                batch.update(results)
        elif op == "tt.load":
            if operands and operands[0] in index_ptrs:
                batch.update(results)
        elif op in ("arith.remsi", "arith.remui", "arith.andi") and any(v in constants for v in operands):
            pass  # bounded by the constant
        elif untraced or any(v in batch for v in operands):
            batch.update(results)
        if op in ("tt.addptr", "tt.splat", "tt.broadcast", "tt.expand_dims"):
            if operands and operands[0] in index_ptrs:
                index_ptrs.update(results)
        if op != "tt.load" and any(v in strided for v in operands):
            strided.update(results)
        if op == "arith.muli" and any(v in batch for v in operands) and any(v in strided for v in operands):
            if _element_type(rest.split(" : ")[-1]) != "i64":
                found.append(line.strip())
    return found


def main() -> None:
    results: dict[str, dict[str, object]] = {}
    for case in [*cases(), PLANTED]:
        params = list(inspect.signature(case.kernel.fn).parameters)
        try:
            compiled = compile_case(case)
            ok = bool(compiled.asm["cubin"]) and ".target sm_90" in compiled.asm["ptx"]
            results[case.key] = {
                "compiled": "ok" if ok else "no sm_90 cubin",
                "int32_index_products": int32_index_products(compiled.asm["ttir"], params),
            }
        except Exception as error:  # noqa: BLE001 (reported, not raised: one bad kernel must not hide the rest)
            results[case.key] = {"compiled": f"{type(error).__name__}: {error}"[:2000], "int32_index_products": []}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
