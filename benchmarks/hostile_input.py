"""Hostile input against a real scheduler: do normal streams keep their pace?

Sixteen normal streams run twice, undisturbed and then while hostile requests arrive: eight
prompts of 4 MiB (read whole, then INVALID_ARGUMENT naming --max-prompt-bytes: the API takes
messages of 4 x --max-prompt-bytes + 16 MiB, so that a long prompt as token ids fits),
eight prompts one byte over --max-prompt-bytes (INVALID_ARGUMENT before any tokenizer sees
them), a JSON schema with maxLength 100,000 (xgrammar compiles it in 1.8 s of CPU into 2.4 MB,
in the niced compiler process: it either serves or ends RESOURCE_EXHAUSTED at
--grammar-compile-timeout) and a JSON schema nested 2,000 deep (INVALID_ARGUMENT naming
--max-grammar-depth, before anything parses it recursively). The undisturbed run is measured
again after, and the disturbed one is compared with the slower of the two, so that a machine
whose load changes meanwhile (other processes on a shared box) does not count as the hostile
requests' doing.

Inter-token latency is the median of per-token gaps over all streams (a message carrying k
tokens counts k gaps of its interval / k). The scheduler runs in this process and the hostile
requests come from another (`--send-hostile`, which the run starts), so this process's RSS is
the scheduler's, and the normal streams' client: sampled during the hostile run, its growth
over the start is reported.

    python benchmarks/hostile_input.py                      # the default model (SmolLM2-135M)
    python benchmarks/hostile_input.py --model DIR --tokens 200

The result JSON goes to benchmarks/results/hostile_input.json (--out). tests/test_hostile_input.py
runs the same functions against the tiny test model.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make the packages importable without install
    sys.path.insert(0, str(REPO_ROOT))

import grpc  # noqa: E402

from common.pb.llmserve.v1 import generation_pb2 as pb  # noqa: E402
from common.pb.llmserve.v1 import generation_pb2_grpc  # noqa: E402

MIB = 1 << 20
MAX_LENGTH_SCHEMA = json.dumps({"type": "string", "maxLength": 100_000})
DEEP_SCHEMA = '{"type": "array", "items": ' * 2000 + '{"type": "integer"}' + "}" * 2000
# What each hostile request may end with: its status code's name ("OK" if it served).
EXPECTED: dict[str, set[str]] = {
    "prompt_4mib": {"INVALID_ARGUMENT"},
    "prompt_over_max_prompt_bytes": {"INVALID_ARGUMENT"},
    "schema_max_length_100000": {"OK", "RESOURCE_EXHAUSTED"},
    "schema_2000_deep": {"INVALID_ARGUMENT"},
}
# What the refusal must name (the flag that raises the limit).
NAMES = {"prompt_over_max_prompt_bytes": "--max-prompt-bytes", "schema_2000_deep": "--max-grammar-depth"}


@dataclass
class StreamRun:
    """Normal streams' pace: the median per-token gap, and how many tokens each produced."""

    itl_median_s: float
    tokens: list[int]
    wall_s: float


@dataclass
class HostileResult:
    name: str
    code: str
    details: str
    seconds: float


@dataclass
class DisturbedRun:
    streams: StreamRun
    hostile: list[HostileResult] = field(default_factory=list)
    rss_start_mib: float = 0.0
    rss_peak_mib: float = 0.0


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def normal_request(i: int, tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt=f"Stream {i}: the quick brown fox jumps over the lazy dog",
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_tokens=tokens, ignore_eos=True),
    )


async def _one_stream(stub: generation_pb2_grpc.GenerationStub, req: pb.GenerateRequest) -> tuple[list[float], int]:
    gaps: list[float] = []
    count = 0
    last: float | None = None
    async for message in stub.Generate(req):
        now = time.perf_counter()
        k = len(message.token_ids)
        if last is not None and k:
            gaps.extend([(now - last) / k] * k)
        if k:
            last = now
        count += k
    return gaps, count


async def run_streams(stub: generation_pb2_grpc.GenerationStub, n: int, tokens: int) -> StreamRun:
    """`n` greedy streams of `tokens` tokens each, at once."""
    start = time.perf_counter()
    results = await asyncio.gather(*(_one_stream(stub, normal_request(i, tokens)) for i in range(n)))
    gaps = [g for stream_gaps, _ in results for g in stream_gaps]
    return StreamRun(statistics.median(gaps), [c for _, c in results], time.perf_counter() - start)


# Prompts of each oversized kind, all sent at once.
OVERSIZED_PROMPTS = 8
BIG_PROMPT_BYTES = 4 * MIB


def oversized_prompt_bytes(max_prompt_bytes: int) -> int:
    """The text of every oversized prompt hostile_requests sends, together."""
    return OVERSIZED_PROMPTS * (BIG_PROMPT_BYTES + max_prompt_bytes + 1)


def hostile_requests(max_prompt_bytes: int) -> list[tuple[str, pb.GenerateRequest]]:
    def schema(text: str) -> pb.GenerateRequest:
        return pb.GenerateRequest(
            prompt="Answer:",
            stopping=pb.StoppingCriteria(max_tokens=8),
            structured_output=pb.StructuredOutput(json_schema=text),
        )

    short = pb.StoppingCriteria(max_tokens=4)
    return [
        *(
            ("prompt_4mib", pb.GenerateRequest(prompt="a" * BIG_PROMPT_BYTES, stopping=short))
            for _ in range(OVERSIZED_PROMPTS)
        ),
        *(
            ("prompt_over_max_prompt_bytes", pb.GenerateRequest(prompt="b" * (max_prompt_bytes + 1), stopping=short))
            for _ in range(OVERSIZED_PROMPTS)
        ),
        ("schema_max_length_100000", schema(MAX_LENGTH_SCHEMA)),
        ("schema_2000_deep", schema(DEEP_SCHEMA)),
    ]


async def _hostile(stub: generation_pb2_grpc.GenerationStub, name: str, req: pb.GenerateRequest) -> HostileResult:
    start = time.perf_counter()
    try:
        async for _ in stub.Generate(req, timeout=120):
            pass
    except grpc.aio.AioRpcError as error:
        return HostileResult(name, error.code().name, error.details() or "", time.perf_counter() - start)
    return HostileResult(name, "OK", "", time.perf_counter() - start)


async def send_hostile(port: int, max_prompt_bytes: int) -> list[HostileResult]:
    """All the hostile requests at once, from a client of their own."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return list(await asyncio.gather(*(_hostile(stub, k, r) for k, r in hostile_requests(max_prompt_bytes))))


async def run_disturbed(
    stub: generation_pb2_grpc.GenerationStub, port: int, n: int, tokens: int, max_prompt_bytes: int
) -> DisturbedRun:
    """The normal streams, with the hostile requests sent once every stream is under way, by
    another process: the copies of its 4 MiB messages are not the scheduler's memory."""
    sender = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--send-hostile",
        str(port),
        "--max-prompt-bytes",
        str(max_prompt_bytes),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert sender.stdin is not None and sender.stdout is not None
    await sender.stdout.readline()  # "ready": it has imported grpc
    rss_start = rss_mib()
    peak = rss_start
    done = asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, rss_mib())
            await asyncio.sleep(0.01)

    async def hostile_soon() -> list[HostileResult]:
        assert sender.stdin is not None and sender.stdout is not None
        await asyncio.sleep(0.05)  # the streams are admitted and decoding by then
        sender.stdin.write(b"go\n")
        await sender.stdin.drain()
        results = json.loads(await sender.stdout.read())
        await sender.wait()
        return [HostileResult(**r) for r in results]

    sampler = asyncio.create_task(sample())
    streams, hostile = await asyncio.gather(run_streams(stub, n, tokens), hostile_soon())
    done.set()
    await sampler
    return DisturbedRun(streams, hostile, rss_start, max(peak, rss_mib()))


async def warm_up(stub: generation_pb2_grpc.GenerationStub) -> None:
    """Load what the first request of a kind loads (xgrammar and its compiler process, the
    tokenizer's caches), so that neither run pays it."""
    await run_streams(stub, 2, 4)
    req = pb.GenerateRequest(
        prompt="Answer:",
        stopping=pb.StoppingCriteria(max_tokens=4),
        structured_output=pb.StructuredOutput(json_schema='{"type": "integer"}'),
    )
    async for _ in stub.Generate(req, timeout=300):
        pass


async def measure(
    stub: generation_pb2_grpc.GenerationStub, port: int, n: int, tokens: int, max_prompt_bytes: int
) -> dict[str, Any]:
    """Warm up, then undisturbed, disturbed and undisturbed again (the scheduler on `port`)."""
    await warm_up(stub)
    before = await run_streams(stub, n, tokens)
    disturbed = await run_disturbed(stub, port, n, tokens, max_prompt_bytes)
    after = await run_streams(stub, n, tokens)
    baseline = max(before.itl_median_s, after.itl_median_s)
    return {
        "before": asdict(before),
        "disturbed": asdict(disturbed),
        "after": asdict(after),
        "itl_ratio": disturbed.streams.itl_median_s / baseline,
        "rss_growth_mib": disturbed.rss_peak_mib - disturbed.rss_start_mib,
        "hostile_as_expected": all(h.code in EXPECTED[h.name] for h in disturbed.hostile),
    }


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    from common.config import SchedulerConfig, ServerConfig
    from scheduler_svc.api.server import SchedulerServer

    worker_port = args.worker_port
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llmserve.cli",
            "--log-level",
            "warning",
            "worker",
            "--model",
            args.model,
            "--listen",
            f"127.0.0.1:{worker_port}",
            "--device",
            "cpu",
            "--num-gpu-blocks",
            str(args.blocks),
        ],
        cwd=REPO_ROOT,
    )
    try:
        config = SchedulerConfig()
        server = SchedulerServer(
            args.model, f"127.0.0.1:{worker_port}", ServerConfig(host="127.0.0.1", port=0), config, step_timeout=120.0
        )
        port = await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                deadline = time.monotonic() + 300
                while not server.engine.ready:
                    if time.monotonic() > deadline or worker.poll() is not None:
                        raise SystemExit("the worker never became ready")
                    await asyncio.sleep(0.1)
                stub = generation_pb2_grpc.GenerationStub(channel)
                return await measure(stub, port, args.streams, args.tokens, config.limits.max_prompt_bytes)
        finally:
            await server.stop()
    finally:
        worker.terminate()
        worker.wait(30)


def _sender(port: int, max_prompt_bytes: int) -> None:
    """--send-hostile: say "ready", wait for "go", send, print the results as JSON."""
    print("ready", flush=True)
    sys.stdin.readline()
    results = asyncio.run(send_hostile(port, max_prompt_bytes))
    print(json.dumps([asdict(r) for r in results]), flush=True)


def main() -> None:
    from llmserve.cli.configs import cache_root

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--send-hostile", type=int, metavar="PORT", help=argparse.SUPPRESS)
    p.add_argument("--max-prompt-bytes", type=int, default=MIB, help=argparse.SUPPRESS)
    p.add_argument("--model", default=str(cache_root() / "models" / "SmolLM2-135M-Instruct"))
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--tokens", type=int, default=128, help="per normal stream")
    p.add_argument("--blocks", type=int, default=512, help="the worker's KV blocks")
    p.add_argument("--worker-port", type=int, default=50391)
    p.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "hostile_input.json"))
    args = p.parse_args()
    if args.send_hostile:
        _sender(args.send_hostile, args.max_prompt_bytes)
        return
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from common import log

    log.configure("warning", json=False)
    result = asyncio.run(_main(args))
    result = {
        "benchmark": "hostile_input",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "config": {"model": args.model, "streams": args.streams, "tokens": args.tokens},
        **result,
    }
    for h in result["disturbed"]["hostile"]:
        print(f"{h['name']:<32} {h['code']:<20} {h['seconds']:6.2f} s  {h['details'][:100]}")
    print(
        f"inter-token latency, median: before {result['before']['itl_median_s'] * 1e3:.2f} ms, "
        f"disturbed {result['disturbed']['streams']['itl_median_s'] * 1e3:.2f} ms, "
        f"after {result['after']['itl_median_s'] * 1e3:.2f} ms: ratio {result['itl_ratio']:.2f}"
    )
    print(f"scheduler RSS growth while disturbed: {result['rss_growth_mib']:.0f} MiB")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
