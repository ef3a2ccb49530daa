"""The offline API against the gRPC path: the same engine, driven two ways, side by side.

benchmarks/throughput.py's workload (seeded random token-id prompts, fixed output lengths,
greedy, ignore_eos) goes through

    grpc      `llmserve up` in its own process, every request sent at once over grpc.aio
              (throughput.py's run_ours)
    offline   `LLM.generate` in this process: the engine on a thread, its worker over a unix socket

in rounds, each path going first every other round. The number compared is output tokens per
second of wall time, from the first request sent to the last one finished (start-up and one
warm-up request are outside the clock for both). Speed on a shared machine drifts between
minutes, so the ratio reported is the median of each round's offline / grpc.

    python benchmarks/offline_throughput.py --repeat 3
    python benchmarks/offline_throughput.py --num-requests 96 --output-len 16,64

The result JSON goes to benchmarks/results/offline-throughput-<YYYYmmdd-HHMMSS>.json (and --out).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # throughput.py, run as a script or loaded by path

import throughput as bench  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=bench._positive_int, default=64, help="requests in the workload (default 64)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--prompt-len", type=bench._length_range, default=bench.PROMPT_LEN, help="prompt lengths MIN,MAX")
    p.add_argument("--output-len", type=bench._length_range, default=bench.OUTPUT_LEN, help="output lengths MIN,MAX")
    p.add_argument("--repeat", type=bench._positive_int, default=1, help="rounds of both paths (default 1)")
    p.add_argument("--dtype", choices=bench.BENCH_DTYPES, default="auto", help="weights dtype (default auto)")
    p.add_argument("--model", default=None, help="model directory (default: the prepared SmolLM2-135M-Instruct)")
    p.add_argument("--max-num-seqs", type=bench._positive_int, default=None, help="engine flag, both paths")
    p.add_argument("--max-num-batched-tokens", type=bench._positive_int, default=None, help="engine flag, both paths")
    p.add_argument("--block-size", type=bench._positive_int, default=None, help="engine flag, both paths")
    p.add_argument("--out", type=Path, default=None, help="also write the result JSON here")
    p.add_argument("--results-dir", type=Path, default=bench.RESULTS_DIR, help="where the dated JSON and logs go")
    args = p.parse_args(argv)
    args.profile_steps = False  # run_ours reads it; neither path pays for step timing
    return args


def engine_flags(args: argparse.Namespace) -> dict[str, int | None]:
    """The engine flags both paths get (throughput.run_ours passes the same to `llmserve up`)."""
    return {k: getattr(args, k) for k in ("max_num_seqs", "max_num_batched_tokens", "block_size")}


def run_offline(args: argparse.Namespace, workload: bench.Workload, model_dir: Path) -> dict[str, Any]:
    from llmserve import LLM, SamplingParams

    bench.log.info("benchmark_phase", engine="offline", phase="start")
    with LLM(str(model_dir), dtype=args.dtype, **{k: v for k, v in engine_flags(args).items() if v is not None}) as llm:
        warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.generate({"prompt_token_ids": workload[0][0][:16]}, warm, use_tqdm=False)
        prompts = [{"prompt_token_ids": p} for p, _ in workload]
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in workload]
        bench.log.info("benchmark_phase", engine="offline", phase="run", requests=len(workload))
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    for i, (out, (_, max_tokens)) in enumerate(zip(outs, workload)):
        got = len(out.outputs[0].token_ids)
        if got != max_tokens:  # tokens/s would mean nothing
            raise RuntimeError(f"request {i}: asked for {max_tokens} tokens, got {got}")
    return bench._engine_result(elapsed, sum(len(o.outputs[0].token_ids) for o in outs))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    bench.logsetup.configure()
    from llmserve.cli.configs import cache_root
    from llmserve.model_prep import prepare_default_model

    model_dir = Path(args.model) if args.model else prepare_default_model(cache_root())
    now = dt.datetime.now()
    stamp = now.strftime("%Y%m%d-%H%M%S")
    workload = bench.make_workload(
        args.num_requests, args.seed, bench._vocab_size(model_dir), args.prompt_len, args.output_len
    )
    runs: dict[str, list[dict[str, Any]]] = {"grpc": [], "offline": []}
    for r in range(args.repeat):
        bench.log.info("benchmark_round", round=r + 1, of=args.repeat)
        # Each path goes first every other round, so a drift within a round favours neither.
        for path in ("grpc", "offline") if r % 2 == 0 else ("offline", "grpc"):
            if path == "grpc":
                runs["grpc"].append(bench.run_ours(args, workload, model_dir, f"{stamp}-{r + 1}", args.results_dir))
            else:
                runs["offline"].append(run_offline(args, workload, model_dir))
    paired = [o["output_tokens_per_s"] / g["output_tokens_per_s"] for g, o in zip(runs["grpc"], runs["offline"])]
    result = {
        "benchmark": "offline_throughput",
        "date": now.isoformat(timespec="seconds"),
        "model": str(model_dir),
        "dtype": {"requested": args.dtype, "resolved": bench.resolve_dtype(args.dtype)},
        "workload": {
            "num_requests": args.num_requests,
            "seed": args.seed,
            "prompt_len": list(args.prompt_len),
            "output_len": list(args.output_len),
            "prompt_tokens": sum(len(p) for p, _ in workload),
            "output_tokens": bench.useful_output_tokens(workload),
            "ignore_eos": True,
            "temperature": 0.0,
        },
        "engine_flags": engine_flags(args),
        "machine": bench.machine(),
        "runs": {name: [r["output_tokens_per_s"] for r in rs] for name, rs in runs.items()},
        "paired_ratios_offline_over_grpc": paired,
        "ratio_offline_over_grpc": statistics.median(paired),
    }
    print(f"{'round':<7}{'grpc tok/s':>12}{'offline tok/s':>15}{'offline/grpc':>14}")
    for i, (g, o, ratio) in enumerate(zip(result["runs"]["grpc"], result["runs"]["offline"], paired), 1):
        print(f"{i:<7}{g:>12.1f}{o:>15.1f}{ratio:>13.2f}x")
    print(f"median offline / grpc: {result['ratio_offline_over_grpc']:.2f}x")
    for path in [args.results_dir / f"offline-throughput-{stamp}.json"] + ([args.out] if args.out else []):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        bench.log.info("result_written", path=str(path))


if __name__ == "__main__":
    main()
