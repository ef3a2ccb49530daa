"""Decode paged attention of the CPU kernels at model scale: many layers, shuffled blocks.

A decode step of --batch sequences, each with --context tokens in the cache, over --layers
separate layer caches (as a model's forward walks them: one call per layer, every layer's K
and V in its own tensors, so the working set is the whole model's cache, not one layer's that
stays in L3). Each sequence's blocks are a random sample of its layer's blocks, in random
order, as a block allocator leaves them after a while. Shapes default to SmolLM2-135M
(9 query heads, 3 KV heads, head_dim 64, bfloat16, block size 16).

    python benchmarks/cpu_attention_bench.py
    python benchmarks/cpu_attention_bench.py --baseline-lib OLD.so [OTHER.so ...]
    python benchmarks/cpu_attention_bench.py --baseline-dense --baseline-lib PRE_RAGGED.so

Reported per library: ms per layer call (median and best over --reps sweeps of all layers)
and GB/s of K and V bytes read, next to the stream-read bandwidth of this machine measured in
the same run (torch sum over a buffer larger than L3). The current build is
kernels.cpu_library.build("native"); each --baseline-lib (another build of the same kernels,
such as one from an older checkout) runs alternately with it, sweep by sweep, in one process,
so load from other users of the machine hits them all alike, and their outputs are compared.
The tables are ragged (block ids and row offsets, common/block_tables.py); a build from before
them took a dense [batch, width] table and its row stride instead (--baseline-dense). Every row
here is as long as the others, so both read the same array.
The result JSON goes to benchmarks/results/cpu-attention-<stamp>.json (and --out).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import structlog
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make the packages importable without install
    sys.path.insert(0, str(REPO_ROOT))

from common import log as logsetup  # noqa: E402
from kernels.cpu_library import RETURNS, SIGNATURES, build  # noqa: E402

log = structlog.get_logger("benchmark")

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=96, help="decoding sequences")
    p.add_argument("--context", type=int, default=300, help="tokens of each sequence in the cache")
    p.add_argument("--layers", type=int, default=30, help="separate layer caches")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--reps", type=int, default=15, help="timed sweeps of all layers, per library")
    p.add_argument(
        "--baseline-lib",
        type=Path,
        nargs="*",
        default=[],
        help="other builds to time against, alternately (named by file stem)",
    )
    p.add_argument(
        "--baseline-dense",
        action="store_true",
        help="the baselines take a dense table and its row stride (builds from before the ragged tables)",
    )
    p.add_argument("--stream-mib", type=int, default=1024, help="buffer of the stream-read measurement")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--out", type=Path, default=None, help="also write the result JSON here")
    return p.parse_args(argv)


def load_attention(path: Path, suffix: str, dense: bool = False) -> Any:
    """The paged_attention entry point of one library file, typed. `dense`: a build from before
    the ragged tables, which takes a table's row stride where the row offsets are now."""
    fn = getattr(ctypes.CDLL(str(path)), f"llmserve_paged_attention_{suffix}")
    argtypes = list(SIGNATURES["paged_attention"])
    if dense:
        argtypes[5] = ctypes.c_int64
    fn.argtypes = argtypes
    fn.restype = RETURNS["paged_attention"]
    return fn


def make_layers(args: argparse.Namespace, dtype: torch.dtype) -> tuple[list[tuple[torch.Tensor, ...]], torch.Tensor]:
    """Per layer (k_cache, v_cache, block_ids); and the step's q [batch, heads, head_dim]."""
    g = torch.Generator().manual_seed(args.seed)
    per_seq = -(-(args.context + 1) // args.block_size)
    num_blocks = args.batch * per_seq + 8
    shape = (num_blocks, args.block_size, args.kv_heads, args.head_dim)  # [blocks, block_size, kv_heads, head_dim]
    layers: list[tuple[torch.Tensor, ...]] = []
    for _ in range(args.layers):
        k_cache = torch.randn(shape, generator=g).to(dtype)
        v_cache = torch.randn(shape, generator=g).to(dtype)
        order = torch.randperm(num_blocks, generator=g)[: args.batch * per_seq]
        block_ids = order.to(torch.int32).contiguous()  # [batch * per_seq]: row i at i * per_seq
        layers.append((k_cache, v_cache, block_ids))
    q = torch.randn(args.batch, args.heads, args.head_dim, generator=g).to(dtype)
    return layers, q


def stream_read_gbs(mib: int, reps: int = 5) -> float:
    """Best read bandwidth of a sum over `mib` MiB (float32), GB/s."""
    buf = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best / 1e9


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logsetup.configure("info")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    libs = {"current": build("native")}
    for path in args.baseline_lib:
        libs[path.stem] = path
    dense = {name: args.baseline_dense and name != "current" for name in libs}
    fns = {name: load_attention(path, args.dtype, dense[name]) for name, path in libs.items()}
    log.info("libraries", **{name: str(path) for name, path in libs.items()})

    layers, q = make_layers(args, dtype)
    out = torch.empty_like(q)
    starts = torch.arange(args.batch, dtype=torch.int32)
    ones = torch.ones(args.batch, dtype=torch.int32)
    per_seq = -(-(args.context + 1) // args.block_size)
    offsets = torch.arange(0, (args.batch + 1) * per_seq, per_seq, dtype=torch.int32)  # [batch + 1]
    seq_lens = torch.full((args.batch,), args.context + 1, dtype=torch.int32)
    scale = args.head_dim**-0.5
    kv_bytes = 2 * args.batch * (args.context + 1) * args.kv_heads * args.head_dim * q.element_size()

    def call(name: str, layer: tuple[torch.Tensor, ...], result: torch.Tensor) -> None:
        fn, (k_cache, v_cache, block_ids) = fns[name], layer
        rows = per_seq if dense[name] else offsets.data_ptr()  # a dense table's row stride, or the row offsets
        status = fn(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_ids.data_ptr(), rows,
            starts.data_ptr(), ones.data_ptr(), seq_lens.data_ptr(), args.batch, args.heads, args.kv_heads,
            args.head_dim, args.block_size, scale, 0, 0.0, result.data_ptr(), result.stride(0), args.threads,
        )  # fmt: skip
        if status != 0:
            raise SystemExit(f"paged_attention refused head_dim {args.head_dim}")

    outputs = {}
    for name in fns:  # warm-up, and each library's answer on layer 0
        for layer in layers:
            call(name, layer, out)
        outputs[name] = out.clone()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(args.reps):
        for name in fns:  # alternately: the same machine state for both
            t0 = time.perf_counter()
            for layer in layers:
                call(name, layer, out)
            times[name].append((time.perf_counter() - t0) / args.layers)
    stream = stream_read_gbs(args.stream_mib)

    results: dict[str, Any] = {}
    for name, ts in times.items():
        median, best = statistics.median(ts), min(ts)
        results[name] = {
            "lib": str(libs[name]),
            "ms_per_layer_median": round(median * 1e3, 4),
            "ms_per_layer_best": round(best * 1e3, 4),
            "kv_gbs_median": round(kv_bytes / median / 1e9, 2),
            "kv_gbs_best": round(kv_bytes / best / 1e9, 2),
        }
        log.info("attention", library=name, **results[name])
    for name in list(times)[1:]:
        diff = (outputs[name].float() - outputs["current"].float()).abs().max().item()
        speedup = round(statistics.median(times["current"]) / statistics.median(times[name]), 3)
        results[name]["max_abs_diff_vs_current"] = diff
        results[name]["speedup_over_current"] = speedup
        log.info("compared", library=name, max_abs_diff=diff, speedup_over_current=speedup)

    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    result = {
        "benchmark": "cpu-attention",
        "date": stamp,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": args.threads},
        "shape": {
            "batch": args.batch,
            "context": args.context,
            "layers": args.layers,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "block_size": args.block_size,
            "dtype": args.dtype,
        },  # fmt: skip
        "kv_mb_per_layer": round(kv_bytes / 1e6, 2),
        "reps": args.reps,
        "stream_read_gbs": round(stream, 2),
        "results": results,
    }
    args.results_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=2) + "\n"
    (args.results_dir / f"cpu-attention-{stamp}.json").write_text(text)
    if args.out is not None:
        args.out.write_text(text)
    print(f"KV read per layer call: {kv_bytes / 1e6:.1f} MB; stream read: {stream:.1f} GB/s")
    for name, r in results.items():
        if isinstance(r, dict):
            print(
                f"{name:>9}: {r['ms_per_layer_median']:.3f} ms/layer median ({r['kv_gbs_median']:.1f} GB/s), "
                f"best {r['ms_per_layer_best']:.3f} ms ({r['kv_gbs_best']:.1f} GB/s)"
            )
    for name, r in results.items():
        if "speedup_over_current" in r:
            print(
                f"{name:>9}: {r['speedup_over_current']:.2f}x the current build; max |diff| {r['max_abs_diff_vs_current']:.3g}"
            )


if __name__ == "__main__":
    main()
