"""What losing a worker costs: the same workload on two registered worker groups, undisturbed,
with one worker killed (SIGKILL) a third of the way through, and on the one survivor alone.

    python benchmarks/recovery_bench.py                     # SmolLM2, 16 streams x 96 tokens
    python benchmarks/recovery_bench.py --model DIR --quick  # any model, a short run

Every phase is greedy float32, so the disturbed run must stream exactly the tokens of the
undisturbed one (checked, per stream). Printed and written to
benchmarks/results/recovery-<YYYYmmdd-HHMMSS>.json: wall time of each phase and their ratios,
the longest pause any stream saw between two messages, and how many requests moved.
vLLM and TGI have no equivalent to compare with: their requests on a lost worker fail.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import structlog

BENCH_DIR = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH_DIR), str(BENCH_DIR.parent)]

from throughput import RESULTS_DIR, _free_port, _Server, _vocab_size, _wait_serving, machine, make_workload  # noqa: E402

from benchmarks.prometheus_scrape import summed  # noqa: E402
from common import log as logsetup  # noqa: E402

log = structlog.get_logger("benchmark")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: the prepared SmolLM2-135M-Instruct)")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="4 requests x 24 tokens (smoke test)")
    p.add_argument("--out", type=Path, default=None, help="also write the result JSON here")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the JSON and the processes' logs go")
    return p.parse_args(argv)


class Cluster:
    """A scheduler and registering CPU workers (float32), each a process of its own."""

    def __init__(
        self,
        model: str,
        logs: Path,
        workers: int = 2,
        scheduler_flags: tuple[str, ...] = (),
        worker_flags: tuple[str, ...] = (),
    ) -> None:
        self.port, self.metrics_port = _free_port(), _free_port()
        self.address = f"127.0.0.1:{self.port}"
        cli = [sys.executable, "-m", "llmserve.cli", "--log-level", "warning"]
        self.scheduler = _Server(
            [
                *cli,
                "scheduler",
                "--model",
                model,
                "--port",
                str(self.port),
                "--metrics-port",
                str(self.metrics_port),
                "--worker-health-interval",
                "1",
                *scheduler_flags,
            ],
            logs / "scheduler.log",
        )
        # CPU workers on one machine split its cores rather than each using all of them
        # (torch's default), which would make the phases with several groups a contest.
        threads = str(max(1, (os.cpu_count() or 2) // workers))
        self.workers = [
            _Server(
                [
                    *cli,
                    "worker",
                    "--model",
                    model,
                    "--listen",
                    f"127.0.0.1:{_free_port()}",
                    "--dtype",
                    "float32",
                    "--device",
                    "cpu",
                    "--scheduler",
                    self.address,
                    *worker_flags,
                ],
                logs / f"worker-{i}.log",
                env={**os.environ, "OMP_NUM_THREADS": threads},
            )
            for i in range(workers)
        ]

    def start(self) -> None:
        for server in (self.scheduler, *self.workers):
            server.start()

    def stop(self) -> None:
        for server in self.workers:
            if server.proc is not None and server.proc.poll() is None:
                os.kill(server.proc.pid, signal.SIGCONT)  # a frozen worker cannot act on SIGTERM
        for server in (*self.workers, self.scheduler):
            server.stop()

    def recovered(self) -> float:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        return summed(url, timeout=5).get("llmserve:requests_recovered_total", 0.0)


async def _groups(stub: Any) -> int:
    from common.pb.llmserve.v1 import generation_pb2 as pb

    return len((await stub.GetLoad(pb.GetLoadRequest())).groups)


async def _phase(
    stub: Any, workload: list[tuple[list[int], int]], kill_at: int | None = None, victim: _Server | None = None
) -> dict[str, Any]:
    """Run every request at once; with kill_at, SIGKILL the victim once that many tokens streamed."""
    from common.pb.llmserve.v1 import generation_pb2 as pb

    streamed = 0
    killed_at: float | None = None
    gaps: list[float] = []

    async def one(prompt: list[int], max_tokens: int) -> list[int]:
        nonlocal streamed, killed_at
        request = pb.GenerateRequest(
            prompt_token_ids=prompt,
            sampling=pb.SamplingParams(temperature=0.0),
            stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
        )
        tokens: list[int] = []
        last = time.perf_counter()
        async for message in stub.Generate(request):
            now = time.perf_counter()
            if tokens:
                gaps.append(now - last)
            last = now
            tokens.extend(message.token_ids)
            streamed += len(message.token_ids)
            if kill_at is not None and killed_at is None and streamed >= kill_at and victim is not None:
                assert victim.proc is not None
                victim.proc.send_signal(signal.SIGKILL)
                killed_at = now
                log.info("worker_killed", pid=victim.proc.pid, tokens_streamed=streamed)
        return tokens

    start = time.perf_counter()
    outputs = await asyncio.gather(*(one(p, n) for p, n in workload))
    elapsed = time.perf_counter() - start
    return {
        "elapsed_s": round(elapsed, 3),
        "outputs": outputs,
        "max_gap_s": round(max(gaps, default=0.0), 3),
        "killed_after_s": None if killed_at is None else round(killed_at - start, 3),
    }


async def _run(args: argparse.Namespace, model: str, stamp: str) -> dict[str, Any]:
    import grpc

    from common.pb.llmserve.v1 import generation_pb2_grpc

    num, max_tokens = (4, 24) if args.quick else (args.num_requests, args.max_tokens)
    workload = [(prompt, max_tokens) for prompt, _ in make_workload(num, args.seed, _vocab_size(Path(model)))]
    total = num * max_tokens
    cluster = Cluster(model, args.results_dir / f"recovery-{stamp}")
    cluster.start()
    try:
        await _wait_serving(cluster.address, cluster.scheduler)
        async with grpc.aio.insecure_channel(cluster.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            while await _groups(stub) < 2:
                for worker in cluster.workers:
                    worker.check_alive()
                await asyncio.sleep(0.2)
            await _phase(stub, workload[:2])  # warm-up, off the clock
            log.info("benchmark_phase", phase="two_groups")
            both = await _phase(stub, workload)
            log.info("benchmark_phase", phase="one_killed", kill_after_tokens=total // 3)
            disturbed = await _phase(stub, workload, kill_at=total // 3, victim=cluster.workers[0])
            log.info("benchmark_phase", phase="survivor_alone")
            alone = await _phase(stub, workload)
            recovered = cluster.recovered()
    finally:
        cluster.stop()
    equal = disturbed["outputs"] == both["outputs"] == alone["outputs"]
    for phase in (both, disturbed, alone):
        del phase["outputs"]
    return {
        "requests": num,
        "max_tokens": max_tokens,
        "output_tokens": total,
        "two_groups": both,
        "one_killed": disturbed,
        "survivor_alone": alone,
        "streams_equal": equal,
        "requests_recovered": recovered,
        "ratio_killed_vs_two_groups": round(disturbed["elapsed_s"] / both["elapsed_s"], 3),
        "ratio_killed_vs_survivor_alone": round(disturbed["elapsed_s"] / alone["elapsed_s"], 3),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logsetup.configure("info")
    model = args.model
    if model is None:
        from llmserve.cli.configs import cache_root
        from llmserve.model_prep import prepare_default_model

        model = str(prepare_default_model(cache_root()))
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    result = asyncio.run(_run(args, model, stamp))
    result = {"benchmark": "recovery", "date": stamp, "model": Path(model).name, "machine": machine(), **result}
    for name in ("two_groups", "one_killed", "survivor_alone"):
        r = result[name]
        print(f"{name:<16}{r['elapsed_s']:>8.2f} s   longest pause between messages {r['max_gap_s']:.2f} s")
    print(f"killed / two groups      {result['ratio_killed_vs_two_groups']:.2f}x")
    print(f"killed / survivor alone  {result['ratio_killed_vs_survivor_alone']:.2f}x")
    print(
        f"requests moved {result['requests_recovered']:.0f}; every stream equal to its undisturbed run: {result['streams_equal']}"
    )
    args.results_dir.mkdir(parents=True, exist_ok=True)
    for path in (args.results_dir / f"recovery-{stamp}.json", args.out):
        if path is not None:
            path.write_text(json.dumps(result, indent=2) + "\n")
    if not result["streams_equal"]:
        sys.exit("a disturbed stream differs from its undisturbed run")


if __name__ == "__main__":
    main()
