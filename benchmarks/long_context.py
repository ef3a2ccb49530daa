"""Contexts of a million tokens: what one long prompt costs the engine, end to end and by part.

The model is a tiny random-weight Llama built here (one layer, one head of 64, which our C++
kernels take; SmolLM2's tokenizer) whose positions reach --long-tokens. Four runs (--runs):

    long     a --long-tokens prompt through `llmserve up` (scheduler and worker processes):
             TTFT, then decode tokens/s of the same prompt again (from the prefix cache),
             peak RSS of the scheduler and of its workers (psutil, sampled), plan bytes and
             the scheduler's ms a step over each (its /metrics)
    plan     no model: scheduler_bench.py's fake worker, decode steps of --short-rows rows
             without and with one more row of --long-tokens: CPU and encoded bytes per plan
             (targets: under 1 MiB, and within 2x of the plan without the long row)
    context  one request at a time at each of --context-lens (tiny model), --smollm2-lens
    kv       no model: requests of log-uniform lengths (--kv-lens) on a --kv-blocks pool;
             after each step is planned, tokens held over slots allocated (target >= 96%)

--window N gives the tiny model a sliding window (Mistral's): an O(n x N) prefill, while the
tables, plans, pool and processes stay those of the whole context.

    python benchmarks/long_context.py [--runs long --window 4096]

The result JSON goes to benchmarks/results/long-context-<YYYYmmdd-HHMMSS>.json (and --out).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make the packages importable without install
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import throughput as tput  # noqa: E402
from benchmarks.long_context_sched import BLOCK, kv_efficiency, prompt, run_plan  # noqa: E402
from benchmarks.prometheus_scrape import summed  # noqa: E402
from benchmarks.step_overlap import write_result  # noqa: E402

log = tput.log
MIB = 1 << 20
GRPC_DEFAULT_MAX_MESSAGE = 4 * MIB  # the scheduler's API server sets no receive limit of its own
SCHEDULER_PARTS = ("plan_build", "plan_encode", "result_decode", "update")


def build_tiny_model(out: Path, tokenizer_from: Path, context: int, window: int, head_dim: int = 64) -> Path:
    """Positions up to `context`, the RoPE base high enough that its slowest frequency does not
    wrap within them; initializer_range large so that greedy choices do not hinge on rounding."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    theta = 10.0 ** math.ceil(math.log10(max(1e4, (context / (2 * math.pi)) ** (head_dim / (head_dim - 2)))))
    params = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=1, initializer_range=0.3)
    params |= dict(num_attention_heads=1, num_key_value_heads=1, head_dim=head_dim, tie_word_embeddings=True)
    params |= dict(max_position_embeddings=context, bos_token_id=1, eos_token_id=2)
    params["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    config_cls, model_cls = (MistralConfig, MistralForCausalLM) if window else (LlamaConfig, LlamaForCausalLM)
    torch.manual_seed(0)
    model_cls(config_cls(**params, **({"sliding_window": window} if window else {}))).save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, out / name)
    return out


def scrape(url: str) -> dict[str, float]:
    # Summed over labels, but for the step parts.
    return summed(url, lambda s: f"{s.name}:{s.labels['part']}" if "part" in s.labels else s.name)


def window_stats(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Steps, mean plan bytes and the scheduler's own ms per step between two scrapes."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps = d.get("llmserve:steps_total", 0.0)
    parts = {p: 1e3 * d.get(f"llmserve:step_part_seconds_total:{p}", 0.0) / max(steps, 1) for p in SCHEDULER_PARTS}
    plan_bytes = d.get("llmserve:step_plan_bytes_sum", 0.0) / max(d.get("llmserve:step_plan_bytes_count", 0), 1)
    return {"steps": int(steps), "plan_bytes_mean": plan_bytes, "scheduler_ms_per_step": sum(parts.values()), **parts}


class Served:
    """`llmserve up --no-http` for `model` with `flags`, on free ports; peak resident memory of
    the scheduler (the `up` process) and of its descendants together (the workers), sampled."""

    def __init__(self, args: argparse.Namespace, model: Path, name: str, flags: list[str]) -> None:
        port, metrics = tput._free_port(), tput._free_port()
        self.address, self.metrics, self.flags = f"127.0.0.1:{port}", f"http://127.0.0.1:{metrics}/metrics", flags
        cmd = [sys.executable, "-m", "llmserve.cli", "up", "--no-http", "--port", str(port), "--metrics-port"]
        cmd += [str(metrics), "--model", str(model), "--dtype", args.dtype, *flags]
        self.server = tput._Server(cmd, args.results_dir / f"long-context-{name}-{args.stamp}.log")
        self.peak, self.done = {"scheduler": 0, "workers": 0}, threading.Event()

    def _sample(self, pid: int) -> None:
        import psutil

        root = psutil.Process(pid)
        while not self.done.wait(0.2):
            try:
                now = {"scheduler": root.memory_info().rss}
                now["workers"] = sum(c.memory_info().rss for c in root.children(recursive=True))
            except psutil.Error:
                continue  # a process ended between the listing and the read
            self.peak = {k: max(v, now[k]) for k, v in self.peak.items()}

    def take_rss(self) -> dict[str, float]:
        """Peaks since the last take, in MiB."""
        peak, self.peak = self.peak, {"scheduler": 0, "workers": 0}
        return {f"{k}_mib": round(v / MIB, 1) for k, v in peak.items()}

    def __enter__(self) -> Served:
        self.server.start()
        assert self.server.proc is not None
        threading.Thread(target=self._sample, args=(self.server.proc.pid,), daemon=True).start()
        try:
            asyncio.run(tput._wait_serving(self.address, self.server))
            asyncio.run(stream(self.address, prompt(16, 1), 4))  # warm-up, outside every number
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.server.stop()


async def stream(address: str, ids: list[int], max_tokens: int) -> dict:
    """One greedy request: TTFT, and decode tokens/s after the first token."""
    import grpc

    from common.pb.llmserve.v1 import generation_pb2 as pb
    from common.pb.llmserve.v1 import generation_pb2_grpc

    stopping = pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True)
    req = pb.GenerateRequest(prompt_token_ids=ids, sampling=pb.SamplingParams(temperature=0.0), stopping=stopping)
    if req.ByteSize() > GRPC_DEFAULT_MAX_MESSAGE:
        raise RuntimeError(f"a {len(ids)}-token request is {req.ByteSize()} bytes, over gRPC's 4 MiB default")
    async with grpc.aio.insecure_channel(address) as channel:
        start, first, tokens = time.perf_counter(), 0.0, 0
        async for msg in generation_pb2_grpc.GenerationStub(channel).Generate(req):
            if msg.token_ids and not first:
                first = time.perf_counter()
            tokens += len(msg.token_ids)
    end = time.perf_counter()
    if tokens != max_tokens:
        raise RuntimeError(f"asked for {max_tokens} tokens, got {tokens}")
    return {"ttft_s": first - start, "decode_tokens_per_s": (tokens - 1) / max(end - first, 1e-9)}


def run_long(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    from tqdm import tqdm

    n, steps = args.long_tokens, -(-args.long_tokens // args.chunk)
    # What a context this long needs: the positions (the model's, --max-model-len), a pool of
    # its blocks and, for a bounded step, a chunk size.
    flags = ["--max-model-len", str(n + args.output_tokens), "--max-num-batched-tokens", str(args.chunk)]
    flags += ["--num-gpu-blocks", str(-(-(n + args.output_tokens) // BLOCK) + 64)]
    with Served(args, model, "long", flags + ["--attention-backend", args.attention_backend]) as s:
        idle, before = s.take_rss(), scrape(s.metrics)
        ids = prompt(n, 2)

        async def prefill() -> dict[str, float]:
            bar = tqdm(total=steps, desc=f"prefill of {n:,} tokens", unit="step")
            task = asyncio.ensure_future(stream(s.address, ids, 1))
            while not task.done():
                now = await asyncio.to_thread(scrape, s.metrics)
                bar.update(int(now["llmserve:steps_total"] - before["llmserve:steps_total"]) - bar.n)
                await asyncio.wait([task], timeout=1.0)
            bar.update(steps - bar.n)
            bar.close()
            return await task

        # Two requests, so that each phase has steps of its own whatever the machine's load: the
        # prompt alone (its only token comes with the last chunk), then the same prompt again,
        # served from the prefix cache (one step recomputes its last position), for the decode.
        # A stream's last message leaves after its step is counted, so the scrape between them
        # splits the steps exactly.
        ttft = asyncio.run(prefill())["ttft_s"]
        middle = scrape(s.metrics)
        decode = asyncio.run(stream(s.address, ids, args.output_tokens))
        timing = {
            "ttft_s": ttft,
            "ttft_cached_s": decode["ttft_s"],
            "decode_tokens_per_s": decode["decode_tokens_per_s"],
        }
        peak, after = s.take_rss(), scrape(s.metrics)
    log.info("long_done", tokens=n, **{k: round(v, 2) for k, v in timing.items()})
    phases = {"prefill": window_stats(before, middle), "decode": window_stats(middle, after)}
    return {"prompt_tokens": n, "engine_flags": s.flags, **timing, "rss_idle": idle, "rss_peak": peak, **phases}


def run_context(args: argparse.Namespace, model: Path, lens: list[int], name: str, flags: list[str]) -> list[dict]:
    if not lens:
        return []
    rows: list[dict[str, Any]] = []
    out = args.output_tokens
    with Served(args, model, name, ["--max-num-batched-tokens", str(args.chunk), *flags]) as s:
        for length in lens:  # one request at a time: a single stream at this context
            # Seeds of their own: a prompt sharing a prefix with an earlier one would hit the prefix cache.
            seeds = range(length * 16, length * 16 + args.context_requests)
            done = [asyncio.run(stream(s.address, prompt(length, seed), out)) for seed in seeds]
            row = {"model": name, "context": length, "requests": len(done)}
            row |= {k: float(np.median([r[k] for r in done])) for k in ("ttft_s", "decode_tokens_per_s")}
            log.info("context_done", **row)
            rows.append(row)
    return rows


def _lens(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    positive, add = tput._positive_int, p.add_argument
    add("--runs", default="long,plan,context,kv", help="which runs, comma-separated (default: all four)")
    add("--long-tokens", type=positive, default=1 << 20, help="the long prompt (1,048,576)")
    add("--output-tokens", type=positive, default=32, help="tokens decoded after each prompt (32)")
    add("--chunk", type=positive, default=8192, help="--max-num-batched-tokens, the prefill chunk (8192)")
    add("--window", type=int, default=0, help="the tiny model's sliding window (0: full attention)")
    add("--attention-backend", default="cpu", choices=("auto", "cpu", "torch"), help="the tiny model's kernels (cpu)")
    add("--dtype", default="auto", choices=tput.BENCH_DTYPES, help="weights and KV (auto)")
    add("--short-rows", type=int, default=255, help="plan run: short rows beside the long one (255)")
    add("--short-tokens", type=positive, default=4096, help="plan run: each short row's context (4096)")
    add("--plan-steps", type=positive, default=100, help="plan run: timed decode steps (100)")
    add("--context-lens", type=_lens, default=[1024, 8192, 32768, 131072], help="context run, tiny model")
    add("--smollm2-lens", type=_lens, default=[1024, 4096, 8000], help="context run, SmolLM2 ('' skips it)")
    add("--context-requests", type=positive, default=3, help="context run: requests per length, one at a time (3)")
    add("--kv-requests", type=positive, default=400, help="kv run: requests (400)")
    add("--kv-lens", type=tput._length_range, default=(16, 32768), help="kv run: total lengths MIN,MAX")
    add("--kv-blocks", type=positive, default=8192, help="kv run: the pool, in blocks of 16 (8192)")
    add("--out", type=Path, default=None, help="also write the result JSON here")
    add("--results-dir", type=Path, default=tput.RESULTS_DIR, help="where the dated result JSON goes")
    args = p.parse_args(argv)
    args.runs = [r for r in args.runs.split(",") if r]
    if unknown := set(args.runs) - {"long", "plan", "context", "kv"}:
        p.error(f"--runs: unknown {sorted(unknown)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    tput.logsetup.configure()
    now = dt.datetime.now()
    args.stamp = now.strftime("%Y%m%d-%H%M%S")
    from llmserve.cli.configs import cache_root
    from llmserve.model_prep import prepare_default_model

    smollm2 = prepare_default_model(cache_root())
    context = max([args.long_tokens, *args.context_lens]) + args.output_tokens + 1
    result: dict[str, Any] = {"benchmark": "long_context", "date": now.isoformat(timespec="seconds")}
    result |= {"machine": tput.machine(), "dtype": tput.resolve_dtype(args.dtype)}
    result["args"] = {k: v for k, v in vars(args).items() if k not in ("out", "results_dir")}
    with tempfile.TemporaryDirectory(prefix="long-context-") as tmp:
        model = build_tiny_model(Path(tmp) / "tiny-long", smollm2, context, args.window)
        result["model"] = json.loads((model / "config.json").read_text())
        backend = ["--attention-backend", args.attention_backend]
        runs: dict[str, Callable[[], Any]] = {
            "long": lambda: run_long(args, model),
            "plan": lambda: run_plan(args),
            "context": lambda: (
                run_context(args, model, args.context_lens, "tiny", backend)
                + run_context(args, smollm2, args.smollm2_lens, "smollm2", [])
            ),
            "kv": lambda: kv_efficiency(args),
        }
        for name in args.runs:
            # A run the product breaks is reported with where it broke; the others still run.
            try:
                result[name] = runs[name]()
            except Exception as error:
                log.exception("run_failed", run=name)
                result[name] = {"error": f"{type(error).__name__}: {error}"}
    report(result)
    write_result(result, "long-context", args, now)
    if any(isinstance(result[name], dict) and "error" in result[name] for name in args.runs):
        sys.exit(1)


# What is printed of each run, filled from its part of the result JSON.
REPORT = {
    "long": "long prompt of {prompt_tokens:,} tokens: TTFT {ttft_s:.1f} s, then {decode_tokens_per_s:.2f} tok/s\n"
    "  the same prompt again, from the prefix cache: TTFT {ttft_cached_s:.2f} s\n"
    "  engine flags: {flags}\n"
    "  peak RSS MiB: scheduler {rss_peak[scheduler_mib]}, workers {rss_peak[workers_mib]} "
    "(after the warm-up: {rss_idle[scheduler_mib]}, {rss_idle[workers_mib]})\n"
    "  prefill: {prefill[steps]} steps, {prefill[plan_bytes_mean]:,.0f} plan bytes, scheduler {prefill[scheduler_ms_per_step]:.3f} ms a step\n"
    "  decode: {decode[steps]} steps, {decode[plan_bytes_mean]:,.0f} plan bytes, scheduler {decode[scheduler_ms_per_step]:.3f} ms a step",
    "plan": "plan of {without_long[rows]} rows: {without_long[plan_bytes_mean]:,.0f} bytes, {without_long[total_us][mean]:.0f} us a step "
    "(build {without_long[build_plan_us][mean]:.0f}, encode {without_long[encode_us][mean]:.0f})\n"
    "plan of {with_long[rows]} rows: {with_long[plan_bytes_mean]:,.0f} bytes, {with_long[total_us][mean]:.0f} us a step "
    "(build {with_long[build_plan_us][mean]:.0f}, encode {with_long[encode_us][mean]:.0f})\n"
    "  with / without the long row: bytes {bytes_ratio:.2f}x, CPU {ms_ratio:.2f}x",
    "context": "context {model:>8} {context:>8,}: TTFT {ttft_s:.2f} s, decode {decode_tokens_per_s:.1f} tok/s",
    "kv": "kv: {steps} steps, tokens held / slots allocated {efficiency_token_weighted:.2%} (per step: mean "
    "{efficiency_mean:.2%}, min {efficiency_min:.2%}); fragmented {pool_fragmented_share_mean:.2%} of the pool, "
    "in use {pool_used_share_mean:.2%}",
}


def report(result: dict[str, Any]) -> None:
    for name, template in REPORT.items():
        part = result.get(name)
        for row in part if isinstance(part, list) else [part] if part else []:
            flags = " ".join(row.get("engine_flags", ()))
            print(f"{name}: {row['error']}" if "error" in row else template.format(**row, flags=flags))


if __name__ == "__main__":
    main()
