"""Registers, spills and shared memory of every kernel configuration a worker launches on a GPU.

Each configuration is compiled offline for sm_90 (Hopper), the way its wrapper launches it
(tiles, warps and pipeline stages from `prefill_launch` / `decode_launch`), with the Triton
IR -> PTX chain and the ptxas bundled in Triton's wheel; no GPU is needed. ptxas -v reports
what one thread needs. A kernel over the register budget (255) spills to local memory (stack
frame, L1/L2 traffic inside the hot loop): the worker's configurations should spill nothing.
One that asks for more than 227 KiB of shared memory (the pipeline's K/V buffers) does not
launch at all.

The compile specialises arguments as a launch does: pointers and strides (multiples of
head_dim or hidden) divisible by 16. Without that hint loads are not vectorised, cannot
become cp.async, and the kernel measured is not the one the GPU runs.

    python benchmarks/kernel_resources.py            # head_dim 64, 80, 96, 128, 256
    python benchmarks/kernel_resources.py --quick    # head_dim 64 and 128

Model dtypes bf16, fp16 and fp32; the per-token kernels at Llama-like widths (32 query and
8 KV heads; hidden 576 to 8192); decode also for multi-query groups of 64 and 128 heads
(full run only). The result JSON goes to
benchmarks/results/kernel_resources.json (--results-dir).
"""

from __future__ import annotations

import os

# Kernels are bound to the interpreter when they are defined: it must be off before any import.
os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns without it; 1 is its default

import argparse  # noqa: E402
import datetime as dt  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from concurrent.futures import ProcessPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make the packages importable without install
    sys.path.insert(0, str(REPO_ROOT))

import triton  # noqa: E402
from tqdm import tqdm  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability  # noqa: E402

from tests.compile_kernels import TARGET, compile_case, worker_cases  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
HEAD_DIMS = (64, 80, 96, 128, 256)
QUICK_HEAD_DIMS = (64, 128)
DTYPES = ("bf16", "fp16", "fp32")
HIDDENS = (576, 2048, 4096, 8192)
QUICK_HIDDENS = (576, 4096)
WIDE_GROUPS = (64, 128)  # multi-query decode: e.g. 48 or 71 query heads over one KV head
SHARED_LIMIT = 232448  # bytes of shared memory one block may use on sm_90 (227 KiB)

_USED = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_STACK = re.compile(r"(\d+) bytes stack frame")


def ptxas_report(ptx: str) -> dict[str, int]:
    """Registers, spill bytes and stack frame of one kernel, from `ptxas -v` with the flags
    Triton compiles with (the cubin Triton keeps has the same numbers)."""
    arch = sm_arch_from_capability(TARGET.arch)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        proc = subprocess.run(
            [
                get_ptxas(TARGET.arch).path,
                "-lineinfo",
                "-v",
                "--regAllocOptLevel=2",
                f"--gpu-name={arch}",
                str(src),
                "-o",
                str(Path(tmp) / "kernel.cubin"),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
    log = proc.stderr + proc.stdout
    used, spills, stack = _USED.search(log), _SPILLS.search(log), _STACK.search(log)
    if used is None or spills is None or stack is None:
        raise RuntimeError(f"unexpected ptxas output:\n{log}")
    return {
        "registers": int(used.group(1)),
        "spill_stores": int(spills.group(1)),
        "spill_loads": int(spills.group(2)),
        "stack_frame": int(stack.group(1)),
    }


Shapes = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # head dims, hidden sizes, wide groups


def measure(job: tuple[Shapes, int]) -> dict[str, Any]:
    """Compile case `index` of worker_cases(...): jobs name their case rather than carry it,
    because a JITFunction does not pickle."""
    (head_dims, hiddens, groups), index = job
    case = worker_cases(head_dims, DTYPES, hiddens, groups)[index]
    compiled = compile_case(case)
    return {
        "config": case.name,
        "dtype": case.dtype,
        "head_dim": case.head_dim,
        "constexprs": dict(case.constexprs),
        "num_warps": case.num_warps,
        "num_stages": case.num_stages,
        **ptxas_report(compiled.asm["ptx"]),
        "shared_bytes": int(compiled.metadata.shared),
        "cp_async": "cp.async" in compiled.asm["ptx"],
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'config':<26}{'dtype':<6}{'warps':>6}{'stages':>7}{'regs':>6}{'spill st/ld (B)':>17}"
        f"{'shared (B)':>12}  cp.async"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        spills = f"{r['spill_stores']}/{r['spill_loads']}"
        print(
            f"{r['config']:<26}{r['dtype']:<6}{r['num_warps']:>6}{r['num_stages']:>7}{r['registers']:>6}"
            f"{spills:>17}{r['shared_bytes']:>12}  {'yes' if r['cp_async'] else 'no'}"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"head_dim {QUICK_HEAD_DIMS} and hidden {QUICK_HIDDENS} only")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiles in parallel (processes)")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where kernel_resources.json goes")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shapes: Shapes = (QUICK_HEAD_DIMS, QUICK_HIDDENS, ()) if args.quick else (HEAD_DIMS, HIDDENS, WIDE_GROUPS)
    cases = worker_cases(shapes[0], DTYPES, shapes[1], shapes[2])
    with ProcessPoolExecutor(max(1, args.jobs)) as pool:
        jobs = [(shapes, i) for i in range(len(cases))]
        rows = list(
            tqdm(pool.map(measure, jobs), total=len(cases), desc="compiling for sm_90", unit="kernel", file=sys.stderr)
        )
    print_table(rows)
    spilling = [f"{r['config']}-{r['dtype']}" for r in rows if r["spill_stores"] or r["spill_loads"]]
    # A launch asking for more shared memory than a block may have fails with "out of resources".
    over_shared = [f"{r['config']}-{r['dtype']}" for r in rows if r["shared_bytes"] > SHARED_LIMIT]
    result = {
        "benchmark": "kernel_resources",
        "date": dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S"),
        "target": sm_arch_from_capability(TARGET.arch),
        "triton": triton.__version__,
        "quick": args.quick,
        "configs": rows,
        "shared_limit_bytes": SHARED_LIMIT,
        "spilling": spilling,
        "over_shared_limit": over_shared,
    }
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / "kernel_resources.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{len(rows)} configurations, {len(spilling)} spilling, {len(over_shared)} over the shared memory limit;"
        f" wrote {path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
