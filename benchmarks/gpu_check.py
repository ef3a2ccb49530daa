"""One command for a GPU machine: kernel tests on CUDA, then kernel and end-to-end benchmarks.

    python benchmarks/gpu_check.py --out gpu_check.json          # on a CUDA machine, < 10 min
    TRITON_INTERPRET=1 python benchmarks/gpu_check.py --smoke    # tiny shapes on CPU: checks the script

Measures, in one JSON file (a section that fails is recorded with its error under its name,
listed in failed_sections, and the rest still run):
  copy_bandwidth   device-to-device copy of a large buffer (bytes read + written per second)
  decode           paged_decode_attention, batch 64 x 4k context (32 query / 8 KV heads of 128),
                   plus a medium and a small case, against SDPA on contiguous tensors; target:
                   >= 60 % of the copy bandwidth on the 64 x 4k case (stretch 80 %)
  prefill          paged_prefill_attention on fresh prompts against causal SDPA; target:
                   >= 40 % of the measured bf16 dense matmul peak
  large_cache      decode over a per-layer cache past 2^31 elements, reading its highest blocks,
                   against torch over the same blocks
  token_limit      RMSNorm, SiLU-and-mul and rotary over a step whose rows pass 2^31 elements
  e2e              greedy decoding of a random-weight Llama-3.2-1B-shaped model (llama3-scaled
                   RoPE) through the worker's ModelRunner and our scheduler: triton with CUDA
                   graphs, triton eager, torch
  sampling_peak    the heaviest step (token budget x 256 sampled rows, top-p, penalties,
                   logprobs) on the sized cache against the memory profile that sized it
  tensor_parallel  `llmserve up --tp 2` against --tp 1, greedy (with 2 GPUs; on CPU in --smoke)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402


def timed(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    """Median seconds per call after a warm-up call (CUDA events on a GPU)."""
    fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: torch.device, numel: int, iters: int) -> float:
    src = torch.empty(numel, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * numel / timed(lambda: dst.copy_(src), iters, device)


def matmul_peak(device: torch.device, n: int, iters: int) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return 2 * n**3 / timed(lambda: a @ b, iters, device)


def random_cache(batch: int, ctx: int, kv_heads: int, head_dim: int, block: int, device: torch.device):
    blocks_per_seq = -(-ctx // block)
    num_blocks = batch * blocks_per_seq
    k = torch.randn(num_blocks, block, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(batch, blocks_per_seq)
    return k, v, tables


def bench_decode(
    batch: int, ctx: int, device: torch.device, iters: int, heads: int = 32, kv_heads: int = 8, head_dim: int = 128
) -> dict[str, Any]:
    from kernels.paged_attention import paged_decode_attention

    k, v, tables = random_cache(batch, ctx, kv_heads, head_dim, 16, device)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, head_dim, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    ours = timed(lambda: paged_decode_attention(q, k, v, tables, seq_lens, head_dim**-0.5, out=out), iters, device)
    kc = torch.randn(batch, kv_heads, ctx, head_dim, device=device, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    qc = q.unsqueeze(2)
    sdpa = timed(lambda: torch.nn.functional.scaled_dot_product_attention(qc, kc, vc, enable_gqa=True), iters, device)
    kv_bytes = 2 * batch * ctx * kv_heads * head_dim * 2
    return {
        "batch": batch,
        "context": ctx,
        "ours_s": ours,
        "sdpa_contiguous_s": sdpa,
        "ours_bytes_per_s": kv_bytes / ours,
        "sdpa_bytes_per_s": kv_bytes / sdpa,
    }


def bench_prefill(
    seqs: int, length: int, device: torch.device, iters: int, heads: int = 32, kv_heads: int = 8, head_dim: int = 128
) -> dict[str, Any]:
    from kernels.prefill_attention import paged_prefill_attention

    k, v, tables = random_cache(seqs, length, kv_heads, head_dim, 16, device)
    seq_lens = torch.full((seqs,), length, dtype=torch.int32, device=device)
    starts = torch.arange(seqs + 1, dtype=torch.int32, device=device) * length
    q = torch.randn(seqs * length, heads, head_dim, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    ours = timed(
        lambda: paged_prefill_attention(q, k, v, tables, starts, seq_lens, head_dim**-0.5, out=out), iters, device
    )
    qc = torch.randn(seqs, heads, length, head_dim, device=device, dtype=torch.bfloat16)
    kc = torch.randn(seqs, kv_heads, length, head_dim, device=device, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    sdpa = timed(
        lambda: torch.nn.functional.scaled_dot_product_attention(qc, kc, vc, is_causal=True, enable_gqa=True),
        iters,
        device,
    )
    flops = seqs * heads * (length * (length + 1) / 2) * head_dim * 4  # causal QK^T and PV
    return {
        "seqs": seqs,
        "length": length,
        "ours_s": ours,
        "sdpa_contiguous_s": sdpa,
        "ours_flops_per_s": flops / ours,
        "sdpa_flops_per_s": flops / sdpa,
    }


def make_model(directory: str, device: torch.device, smoke: bool) -> dict[str, Any]:
    """A random-weight Llama-3.2-1B-shaped checkpoint (llama3-scaled RoPE, 128k vocabulary),
    tiny with `smoke`; returns its shape."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = (
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
            max_position_embeddings=512,
        )
        if smoke
        else dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128256,
            max_position_embeddings=8192,
        )
    )
    shape["rope_parameters"] = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256 if smoke else 8192,
    }
    torch.manual_seed(0)
    with torch.device(device):  # random init of 1.2B parameters is much faster on the GPU
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, initializer_range=0.05, **shape))
    model.to(torch.bfloat16).save_pretrained(directory)
    _write_tokenizer(directory, int(shape["vocab_size"]))  # type: ignore[call-overload]
    return shape


def _write_tokenizer(directory: str, vocab_size: int) -> None:
    """A word-level tokenizer with one word per id ("t0", "t1", ...): the services need a fast
    tokenizer, and a GPU machine without network access cannot download one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0").save_pretrained(directory)


def bench_e2e(model_dir: str, shape: dict[str, Any], device: torch.device, smoke: bool, steps: int) -> dict[str, Any]:
    """Greedy decoding through ModelRunner + Scheduler, same weights: the triton backend with
    CUDA graphs for decode steps, the triton backend eager (--enforce-eager), and torch."""
    import numpy as np

    from common.config import CacheConfig, SchedulerConfig, WorkerConfig
    from scheduler_svc.kv.block_manager import BlockManager
    from scheduler_svc.sched.scheduler import Scheduler
    from scheduler_svc.sched.sequence import SamplingOptions, Sequence, StoppingParams
    from scheduler_svc.sched.sequence_group import SequenceGroup
    from worker_svc.step.runner import ModelRunner

    results: dict[str, Any] = {"layers": shape["num_hidden_layers"], "hidden": shape["hidden_size"]}
    tokens: dict[str, list[list[int]]] = {}
    for name, backend, eager in (
        ("triton", "triton", False),
        ("triton_eager", "triton", True),
        ("torch", "torch", True),
    ):
        dtype = "float32" if device.type == "cpu" else "bfloat16"
        runner = ModelRunner(
            WorkerConfig(
                model=model_dir,
                dtype=dtype,
                device=str(device),
                attention_backend=backend,
                cache=CacheConfig(num_gpu_blocks=64 if smoke else 4096),
                enforce_eager=eager,
                max_num_seqs=4 if smoke else 32,
            )
        )
        sched = Scheduler(SchedulerConfig(), BlockManager(runner.kv.num_blocks, 16), runner.max_model_len, frozenset())
        rng = np.random.default_rng(0)
        seqs = [
            Sequence(
                i,
                str(i),
                rng.integers(10, shape["vocab_size"], 16 + 8 * i).tolist(),
                SamplingOptions(),
                StoppingParams(max_tokens=steps),
                arrival=i,
            )
            for i in range(4 if smoke else 32)
        ]
        for s in seqs:
            sched.add(SequenceGroup.of(s))
        start, generated = time.perf_counter(), 0
        while (plan := sched.schedule()) is not None:
            generated += len(sched.update(plan, runner.execute(plan)))
        seconds = time.perf_counter() - start
        tokens[name] = [s.output_token_ids for s in seqs]
        results[name] = {
            "output_tokens": generated,
            "seconds": seconds,
            "tokens_per_s": generated / seconds,
            "cuda_graphs": runner._graphs is not None,
        }
        del runner
        if device.type == "cuda":
            torch.cuda.empty_cache()
    same = sum(a == b for a, b in zip(tokens["triton"], tokens["torch"]))
    results["sequences_identical_between_backends"] = f"{same}/{len(tokens['torch'])}"
    same = sum(a == b for a, b in zip(tokens["triton"], tokens["triton_eager"]))
    results["sequences_identical_graphs_vs_eager"] = f"{same}/{len(tokens['triton'])}"
    results["graphs_speedup"] = results["triton"]["tokens_per_s"] / results["triton_eager"]["tokens_per_s"]
    return results


INT32_LIMIT = 1 << 31


def check_large_cache(device: torch.device, smoke: bool) -> dict[str, Any]:
    """Decode over a per-layer cache of more than 2^31 elements, reading its highest blocks
    (where a 32-bit block offset wraps), against attention over the same blocks in torch."""
    from kernels.paged_attention import paged_decode_attention

    heads, kv_heads, head_dim, block, batch, ctx = (4, 2, 64, 16, 2, 64) if smoke else (32, 8, 128, 16, 4, 512)
    stride = block * kv_heads * head_dim
    num_blocks = 64 if smoke else INT32_LIMIT // stride + 1024
    k = torch.empty(num_blocks, block, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    v = torch.empty_like(k)
    per_seq = ctx // block
    tables = (num_blocks - 1 - torch.arange(batch * per_seq, device=device)).view(batch, per_seq).to(torch.int32)
    used = tables.flatten().long()
    k[used] = torch.randn(used.numel(), block, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    v[used] = torch.randn_like(k[used])
    q = torch.randn(batch, heads, head_dim, device=device, dtype=torch.bfloat16)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    out = paged_decode_attention(q, k, v, tables, seq_lens, head_dim**-0.5)
    kc = k[tables.long()].reshape(batch, ctx, kv_heads, head_dim).transpose(1, 2).float()
    vc = v[tables.long()].reshape(batch, ctx, kv_heads, head_dim).transpose(1, 2).float()
    ref = torch.nn.functional.scaled_dot_product_attention(q.float().unsqueeze(2), kc, vc, enable_gqa=True).squeeze(2)
    err = float((out.float() - ref).abs().max())
    return {
        "elements_per_layer": k.numel(),
        "past_int32": k.numel() > INT32_LIMIT,
        "highest_element_read": (num_blocks * stride) - 1,
        "max_abs_err": err,
        "ok": err < 3e-2,
    }


def check_token_limit(device: torch.device, smoke: bool) -> dict[str, Any]:
    """Row kernels over a step whose rows x row stride pass 2^31 elements (where 32-bit row
    offsets wrapped): RMSNorm with residual, SiLU-and-mul and rotary, checked on the last rows."""
    from kernels.activation import silu_and_mul, silu_and_mul_reference
    from kernels.rms_norm import rms_norm, rms_norm_reference
    from kernels.rotary import apply_rotary, apply_rotary_reference

    hidden, heads, head_dim = (64, 4, 16) if smoke else (8192, 32, 128)
    tail = 64
    results: dict[str, Any] = {}

    def rows_past(width: int) -> int:
        return 256 if smoke else INT32_LIMIT // width + 1024

    def record(name: str, tokens: int, width: int, got: torch.Tensor, want: torch.Tensor) -> None:
        # Relative to the largest value: both sides round to bfloat16 (a unit in the last place is 2^-8).
        err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
        results[name] = {
            "tokens": tokens,
            "elements": tokens * width,
            "past_int32": tokens * width > INT32_LIMIT,
            "max_rel_err_last_rows": err,
            "ok": err < 2e-2,
        }
        print(f"token limit {name}: {tokens} tokens, relative error {err:.3g}", flush=True)

    tokens = rows_past(hidden)
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, device=device, dtype=torch.bfloat16)
    want, _ = rms_norm_reference(x[-tail:], weight, 1e-6, residual[-tail:].clone())
    got, _ = rms_norm(x, weight, 1e-6, residual)
    record("rms_norm", tokens, hidden, got[-tail:], want)
    del x, residual, got

    tokens = rows_past(2 * hidden)
    x = torch.randn(tokens, 2 * hidden, device=device, dtype=torch.bfloat16)
    got = silu_and_mul(x)
    want = silu_and_mul_reference(x[-tail:])
    record("silu_and_mul", tokens, 2 * hidden, got[-tail:], want)
    del x, got

    tokens = rows_past(heads * head_dim)
    q = torch.randn(tokens, heads, head_dim, device=device, dtype=torch.bfloat16)
    k = torch.randn(tokens, max(1, heads // 4), head_dim, device=device, dtype=torch.bfloat16)
    positions = torch.arange(tokens, device=device, dtype=torch.int64) % 4096
    angles = torch.arange(4096, device=device, dtype=torch.float32)[:, None] * torch.rand(head_dim // 2, device=device)
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    want_q, _ = apply_rotary_reference(q[-tail:], k[-tail:], positions[-tail:], cos, sin)
    apply_rotary(q, k, positions, cos, sin)
    record("rotary", tokens, heads * head_dim, q[-tail:], want_q)
    return results


def check_sampling_peak(model_dir: str, device: torch.device) -> dict[str, Any]:
    """The heaviest step run on the sized cache peaks no higher than the profile that sized it."""
    from common.config import CacheConfig, WorkerConfig
    from worker_svc.step.probe_plans import heaviest_step
    from worker_svc.step.runner import ModelRunner

    runner = ModelRunner(
        WorkerConfig(
            model=model_dir,
            dtype="bfloat16",
            device=str(device),
            attention_backend="triton",
            cache=CacheConfig(gpu_memory_utilization=0.5),
            max_num_seqs=256,
            max_num_batched_tokens=8192,
        )
    )
    plan, _ = heaviest_step(8192, 256, runner.block_size, runner.shape.vocab_size)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    runner.execute(plan)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    profiled = runner.profiled_peak_bytes
    return {
        "profiled_peak_bytes": profiled,
        "measured_step_peak_bytes": peak,
        "within_profile": profiled is not None and peak <= profiled,
        "num_gpu_blocks": runner.kv.num_blocks,
    }


def check_tensor_parallel(model_dir: str, device: torch.device, smoke: bool) -> dict[str, Any]:
    """`llmserve up --tp 2` streams, greedy, what `--tp 1` streams (bfloat16 on CUDA: NCCL)."""
    import signal
    import socket

    from llmserve.client import LlmserveClient

    prompts = [[300 + 17 * i + j for j in range(8 + 24 * i)] for i in range(4)]
    outputs: dict[int, list[list[int]]] = {}
    seconds: dict[int, float] = {}
    for tp in (1, 2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dtype = "bfloat16" if device.type == "cuda" else "float32"
        cmd = [
            sys.executable,
            "-m",
            "llmserve.cli",
            "--log-level",
            "warning",
            "up",
            "--model",
            model_dir,
            "--port",
            str(port),
            "--tp",
            str(tp),
            "--device",
            device.type,
            "--dtype",
            dtype,
            "--no-http",
        ]
        if device.type == "cpu":
            cmd += ["--num-gpu-blocks", "64", "--num-cpu-blocks", "0"]
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT)
        try:
            _wait_serving(f"127.0.0.1:{port}", proc, f"llmserve up --tp {tp}")
            with LlmserveClient(f"127.0.0.1:{port}") as client:
                start = time.perf_counter()
                outputs[tp] = [
                    [
                        t
                        for m in client.generate(prompt_token_ids=p, max_tokens=24, ignore_eos=True)
                        for t in m.token_ids
                    ]
                    for p in prompts
                ]
                seconds[tp] = time.perf_counter() - start
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    same = sum(a == b for a, b in zip(outputs[1], outputs[2]))
    return {"sequences_identical_tp2_vs_tp1": f"{same}/{len(prompts)}", "seconds": seconds}


def _wait_serving(address: str, proc: subprocess.Popen[bytes], what: str, timeout: float = 600) -> None:
    """Until the service's health check says SERVING (its workers are ready)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                pass  # not listening yet
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start serving")
            time.sleep(1)


def run_kernel_tests() -> dict[str, Any]:
    try:
        import pytest  # noqa: F401
    except ImportError:
        return {
            "returncode": 0,
            "summary": ["skipped: pytest is not installed here"],
            "seconds": 0.0,
            "output_tail": "",
        }
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "tests/test_kernels.py",
        "tests/test_runner.py",
        "tests/test_block_ops.py",
        "tests/test_model_forward.py",
        "tests/test_cuda_graphs.py",
        "--full-kernels",
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
    tail = proc.stdout.strip().splitlines()[-1:] if proc.stdout.strip() else []
    return {
        "returncode": proc.returncode,
        "summary": tail,
        "seconds": time.perf_counter() - start,
        "output_tail": proc.stdout[-4000:] if proc.returncode else "",
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="JSON result path (default: $OUT/gpu_check.json, else ./gpu_check.json)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, any device: checks the script itself")
    p.add_argument("--skip-tests", action="store_true", help="benchmarks only")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per benchmark (median reported)")
    args = p.parse_args(argv)
    if args.iters < 1:
        p.error("--iters must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print(
            "gpu_check needs CUDA; run with --smoke (and TRITON_INTERPRET=1) to check the script on CPU",
            file=sys.stderr,
        )
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    out_path = Path(args.out or Path(os.environ.get("OUT", ".")) / "gpu_check.json")
    iters = 2 if args.smoke else args.iters
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "smoke": args.smoke,
    }
    import triton

    result["triton"] = triton.__version__

    def save() -> None:
        """Write what is measured so far: a later section that fails loses nothing before it."""
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=2) + "\n")

    failed: list[str] = []

    def section(name: str, measure: Callable[[], Any]) -> Any:
        """Runs one section into result[name]; one that raises is recorded there with its
        error and the rest still run (a device run is rarely repeated)."""
        try:
            result[name] = measure()
        except Exception as error:  # noqa: BLE001 - every failure is reported, none stops the run
            failed.append(name)
            result[name] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-4000:]}
            print(f"{name} FAILED: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        save()
        return result[name]

    if cuda and not args.skip_tests:
        section("kernel_tests", run_kernel_tests)
        print("kernel tests:", result["kernel_tests"].get("summary", result["kernel_tests"].get("error")), flush=True)
    copy_bw = section(
        "copy_bandwidth_bytes_per_s", lambda: copy_bandwidth(device, (1 << 20) if args.smoke else (2 << 30), iters)
    )
    peak = section("bf16_matmul_peak_flops_per_s", lambda: matmul_peak(device, 256 if args.smoke else 8192, iters))

    def decode() -> list[dict[str, Any]]:
        cases = [(2, 64)] if args.smoke else [(64, 4096), (16, 1024), (4, 256)]
        measured = [bench_decode(b, c, device, iters, *((4, 2, 64) if args.smoke else ())) for b, c in cases]
        for case in measured:
            case["fraction_of_copy_bandwidth"] = case["ours_bytes_per_s"] / copy_bw
            print(
                f"decode b={case['batch']} ctx={case['context']}: {case['ours_s'] * 1e6:.0f} us, "
                f"{case['fraction_of_copy_bandwidth']:.0%} of copy bandwidth, "
                f"sdpa {case['sdpa_contiguous_s'] * 1e6:.0f} us",
                flush=True,
            )
        return measured

    def prefill() -> list[dict[str, Any]]:
        cases = [(2, 48)] if args.smoke else [(4, 2048), (1, 8192)]
        measured = [bench_prefill(s, n, device, iters, *((4, 2, 64) if args.smoke else ())) for s, n in cases]
        for case in measured:
            case["fraction_of_matmul_peak"] = case["ours_flops_per_s"] / peak
            print(
                f"prefill {case['seqs']}x{case['length']}: {case['ours_flops_per_s'] / 1e12:.1f} TFLOP/s, "
                f"{case['fraction_of_matmul_peak']:.0%} of peak, sdpa {case['sdpa_flops_per_s'] / 1e12:.1f}",
                flush=True,
            )
        return measured

    section("decode", decode)
    section("prefill", prefill)
    print("large cache:", json.dumps(section("large_cache", lambda: check_large_cache(device, args.smoke))), flush=True)
    section("token_limit", lambda: check_token_limit(device, args.smoke))
    with tempfile.TemporaryDirectory() as model_dir:
        shape = section("model", lambda: make_model(model_dir, device, args.smoke))
        if "model" not in failed:
            e2e = section(
                "e2e", lambda: bench_e2e(model_dir, shape, device, args.smoke, steps=4 if args.smoke else 128)
            )
            print("e2e:", json.dumps(e2e), flush=True)
            if cuda:
                print(
                    "sampling peak:",
                    json.dumps(section("sampling_peak", lambda: check_sampling_peak(model_dir, device))),
                    flush=True,
                )
            if torch.cuda.device_count() >= 2 or args.smoke:
                tp = section("tensor_parallel", lambda: check_tensor_parallel(model_dir, device, args.smoke))
                print("tensor parallel:", json.dumps(tp), flush=True)

    def targets() -> dict[str, Any]:
        return {
            "decode_64x4k_fraction_of_copy_bandwidth": result["decode"][0]["fraction_of_copy_bandwidth"],
            "decode_target_met": result["decode"][0]["fraction_of_copy_bandwidth"] >= 0.6,
            "prefill_fraction_of_peak": result["prefill"][0]["fraction_of_matmul_peak"],
            "prefill_target_met": result["prefill"][0]["fraction_of_matmul_peak"] >= 0.4,
        }

    section("targets", targets)
    result["failed_sections"] = failed
    save()
    print(f"wrote {out_path}")
    return 0 if not failed and result.get("kernel_tests", {}).get("returncode", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
