"""End-to-end serving numbers on a model of a realistic size, and its memory against the limit.

throughput: the benchmark workload of benchmarks/throughput.py (64 requests, prompts of
32-256 random ids, 32-128 greedy output tokens each, all submitted at once) through our
scheduler and the worker's runner, on a random-weight Llama-3.2-1B-shaped model in bfloat16,
with the decode steps replayed from CUDA graphs and without. Output tokens/s and time to
first token; the two runs' tokens should agree (random weights give flat logits, so a few
near-ties may not).

memory_peak: a worker sizes its KV cache so that the device's use stays under
--gpu-memory-utilization (worker_svc/step/device_memory.py: kv_budget). Built with 0.5 and the
decode graphs captured, then run on the heaviest step it profiled for, the device's peak use
must lie within 0.5 of its memory: the margin is what is left below that line.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch

from gpu_check import checkpoints
from gpu_check.context import Context, Skip
from gpu_check.engine import build_runner, run_requests

REQUESTS, TINY_REQUESTS = 64, 4
MAX_NUM_SEQS = 64
UTILIZATION = 0.5
HEAVIEST_TOKENS, HEAVIEST_SEQS = 8192, 256


def _model(ctx: Context) -> Path:
    return ctx.shared("llama_1b", lambda: checkpoints.llama_1b(ctx.workdir / "llama-1b", ctx.device, ctx.tiny))


def _dtype(ctx: Context) -> str:
    return "bfloat16" if ctx.cuda else "float32"


def workload(ctx: Context, vocab_size: int) -> list[tuple[list[int], int]]:
    """benchmarks/throughput.py's own generator, so that these numbers are comparable to its
    tables (loaded by path: benchmarks/ is a folder of scripts, not a package)."""
    path = Path(__file__).resolve().parent.parent / "throughput.py"
    spec = importlib.util.spec_from_file_location("gpu_check_throughput", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    if ctx.tiny:
        return list(module.make_workload(TINY_REQUESTS, 0, vocab_size, (8, 24), (2, 4)))
    return list(module.make_workload(REQUESTS, 0, vocab_size))


def throughput(ctx: Context) -> dict[str, Any]:
    model = _model(ctx)
    result: dict[str, Any] = {"model": "random Llama-3.2-1B shape" if not ctx.tiny else "tiny random Llama"}
    outputs = {}
    for name, eager in (("graphs", False), ("eager", True)):
        runner = build_runner(
            ctx,
            str(model),
            _dtype(ctx),
            max_num_seqs=MAX_NUM_SEQS,
            enforce_eager=eager,
            cache={"num_gpu_blocks": 4096 if not ctx.tiny else 128},
        )
        requests = workload(ctx, runner.shape.vocab_size)
        if ctx.dry:
            result[name] = {"constructed": True, "requests": len(requests)}
        else:
            run = run_requests(runner, requests)
            result[name] = {**run.stats(), "cuda_graphs": runner._graphs is not None}
            outputs[name] = run.outputs
        del runner
        ctx.release()
    if ctx.dry:
        result["summary"] = f"constructed both runners, {result['graphs']['requests']} requests"
        return result
    same = sum(a == b for a, b in zip(outputs["graphs"], outputs["eager"]))
    result["sequences_identical_graphs_vs_eager"] = f"{same}/{len(outputs['eager'])}"
    g, e = result["graphs"], result["eager"]
    result["graphs_speedup"] = g["output_tokens_per_s"] / e["output_tokens_per_s"]
    result["summary"] = (
        f"graphs {g['output_tokens_per_s']:.0f} tok/s, TTFT p50 {g['ttft_median_s'] * 1e3:.0f} ms; "
        f"eager {e['output_tokens_per_s']:.0f} tok/s; identical {result['sequences_identical_graphs_vs_eager']}"
    )
    return result


def memory_peak(ctx: Context) -> dict[str, Any]:
    from worker_svc.step.probe_plans import heaviest_step

    model = _model(ctx)
    if not ctx.cuda:
        if ctx.dry:
            plan, blocks = heaviest_step(64, 4, 16, checkpoints.TINY_VOCAB)
            return {"summary": f"heaviest step built ({plan.num_tokens} tokens); measured on CUDA only"}
        raise Skip("measures CUDA memory (torch.cuda.mem_get_info)")
    device = ctx.device
    torch.cuda.reset_peak_memory_stats(device)
    runner = build_runner(
        ctx,
        str(model),
        _dtype(ctx),
        max_num_seqs=HEAVIEST_SEQS,
        max_num_batched_tokens=HEAVIEST_TOKENS,
        cache={"num_gpu_blocks": None, "gpu_memory_utilization": UTILIZATION},
    )
    plan, _ = heaviest_step(HEAVIEST_TOKENS, HEAVIEST_SEQS, runner.block_size, runner.shape.vocab_size)
    runner.execute(plan)
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    reserved_now = torch.cuda.memory_reserved(device)
    reserved_peak = torch.cuda.max_memory_reserved(device)
    # What the device held at this process's peak: all it holds now, plus what torch's pool
    # held at its peak beyond what it holds now (the profile's probes, the step's temporaries).
    peak_used = (total - free) + (reserved_peak - reserved_now)
    limit = UTILIZATION * total
    result = {
        "total_bytes": total,
        "limit_bytes": limit,
        "used_after_step_bytes": total - free,
        "peak_used_bytes": peak_used,
        "margin_bytes": limit - peak_used,
        "max_memory_reserved_bytes": reserved_peak,
        "max_memory_allocated_bytes": torch.cuda.max_memory_allocated(device),
        "profiled_step_peak_bytes": runner.profiled_peak_bytes,
        "graph_pool_bytes": runner.graph_pool_bytes,
        "kv_blocks": runner.kv.num_blocks,
        "kv_bytes": runner.kv.nbytes,
        "cuda_graphs": runner._graphs is not None,
        "passed": peak_used <= limit,
    }
    gib = 1 << 30
    result["summary"] = (
        f"peak {peak_used / gib:.1f} GiB of {limit / gib:.1f} GiB allowed "
        f"(margin {(limit - peak_used) / gib:.2f} GiB), KV {runner.kv.nbytes / gib:.1f} GiB"
    )
    del runner
    return result
