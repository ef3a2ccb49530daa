"""Two worker groups of unequal speed under one scheduler: the share of the tokens each computes.

Two stand-in workers (benchmarks/step_overlap.py's sleeping runner behind the real Worker
service) serve one real scheduler process; a step of the slow one sleeps --slowdown times as
long as the same step of the fast one (a fixed part plus a part per token in the step, as a
real step grows with its tokens). --clients callers each send requests one after another
(16-token prompts, --min-tokens to --max-tokens output tokens, greedy, ignore_eos); then, with
both groups measured, --num-requests more arrive at once (a burst). Each stand-in logs the
tokens it sampled per step, and each phase counts the steps that started in it.

Target: with one group twice as slow, the fast one samples 60-73% of the tokens (two thirds is
the split in proportion to speed) in both phases. In the closed loop, room alone comes close
(the slow group holds its requests longer, so it has less room); in a burst, room alone splits
the requests evenly, and only the measured speeds give the fast group its share.

    python benchmarks/unequal_groups.py
    python benchmarks/unequal_groups.py --slowdown 3 --clients 64

The result JSON goes to benchmarks/results/unequal-groups-<YYYYmmdd-HHMMSS>.json (and --out).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make the packages importable without install
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.prometheus_scrape import samples  # noqa: E402
from benchmarks.step_overlap import _free_port, _wait_ready, write_result  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
STANDIN = Path(__file__).resolve().parent / "step_overlap.py"


def _standin(model: Path, port: int, step_ms: float, token_ms: float, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, str(STANDIN), "--standin", "--model", str(model), "--listen", f"127.0.0.1:{port}"]
    cmd += ["--step-ms", str(step_ms), "--token-ms", str(token_ms), "--log", str(log)]
    return subprocess.Popen(cmd, cwd=REPO_ROOT)


async def _drive(port: int, args: argparse.Namespace) -> list[tuple[int, float, float]]:
    """(tokens, start, end) of the closed loop, then of the burst."""
    import grpc
    import structlog

    from common.pb.llmserve.v1 import generation_pb2 as pb
    from common.pb.llmserve.v1 import generation_pb2_grpc

    log = structlog.get_logger("unequal_groups")
    rng = random.Random(args.seed)
    work = [rng.randint(args.min_tokens, args.max_tokens) for _ in range(args.num_requests)]
    done = 0

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def client(c: int, clients: int) -> int:
            nonlocal done
            streamed = 0
            for i in range(c, len(work), clients):
                request = pb.GenerateRequest(
                    prompt_token_ids=[200 + (i * 13 + k) % 1000 for k in range(16)],
                    sampling=pb.SamplingParams(temperature=0.0),
                    stopping=pb.StoppingCriteria(max_tokens=work[i], ignore_eos=True),
                )
                streamed += sum([len(m.token_ids) async for m in stub.Generate(request)])
                done += 1
                if done % max(len(work) // 8, 1) == 0:
                    log.info("progress", finished=done, total=len(work))
            return streamed

        phases = []
        for clients in (args.clients, len(work)):  # one request at a time each, then all at once
            start = time.perf_counter()
            counts = await asyncio.gather(*(client(c, clients) for c in range(clients)))
            if sum(counts) != sum(work):
                raise RuntimeError(f"streamed {sum(counts)} tokens, expected {sum(work)}")
            phases.append((sum(counts), start, time.perf_counter()))
            done = 0
        return phases


def _wait_groups(metrics_port: int, want: int, timeout_s: float = 120.0) -> None:
    """Until the scheduler serves with `want` worker groups (each reports its KV blocks): it
    serves once one is ready, and a closed loop begun then could run on that one alone."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready = {
            s.labels["group"]
            for s in samples(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5)
            if s.name == "llmserve:group_gpu_blocks" and s.value > 0
        }
        if len(ready) >= want:
            return
        time.sleep(0.2)
    raise TimeoutError(f"the scheduler did not report {want} worker groups in {timeout_s:.0f} s")


def run(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    ports = {"fast": _free_port(), "slow": _free_port()}
    cost = {"fast": 1.0, "slow": args.slowdown}
    port, metrics_port = _free_port(), _free_port()
    with tempfile.TemporaryDirectory(prefix="llmserve-unequal-") as tmp:
        logs = {name: Path(tmp) / f"{name}.json" for name in ports}
        standins = {
            name: _standin(model, ports[name], args.step_ms * cost[name], args.token_ms * cost[name], logs[name])
            for name in ports
        }
        cmd = [sys.executable, "-m", "llmserve.cli", "--log-level", "warning", "scheduler", "--model", str(model)]
        cmd += ["--port", str(port), "--metrics-port", str(metrics_port)]
        for name in ("slow", "fast"):  # the slow one first: a tie between unmeasured groups goes to it
            cmd += ["--worker", f"127.0.0.1:{ports[name]}"]
        scheduler = subprocess.Popen(cmd, cwd=REPO_ROOT)
        procs = [scheduler, *standins.values()]
        try:
            asyncio.run(_wait_ready(port, *procs))
            _wait_groups(metrics_port, len(ports))
            phases = asyncio.run(_drive(port, args))
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        steps = {name: json.loads(logs[name].read_text()) for name in ports}
    result = {}
    for phase, (tokens, start, end) in zip(("closed_loop", "burst"), phases, strict=True):
        inside = {name: [s for s in steps[name] if start <= s[1] < end] for name in ports}
        sampled = {name: sum(s[3] for s in inside[name]) for name in ports}
        result[phase] = {
            "tokens": tokens,
            "wall_s": end - start,
            "output_tokens_per_s": tokens / (end - start),
            "groups": {
                name: {
                    "cost": cost[name],
                    "steps": len(inside[name]),
                    "sampled_tokens": sampled[name],
                    "token_share": sampled[name] / max(sum(sampled.values()), 1),
                    "busy_share_of_wall": sum(s[2] - s[1] for s in inside[name]) / (end - start),
                }
                for name in ports
            },
        }
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slowdown", type=float, default=2.0, help="how many times slower the slow group is (default 2)")
    p.add_argument("--step-ms", type=float, default=2.0, help="the fast stand-in's fixed cost per step (default 2)")
    p.add_argument("--token-ms", type=float, default=0.25, help="its cost per token in a step (default 0.25)")
    p.add_argument("--clients", type=int, default=48, help="callers, each sending one request at a time (default 48)")
    p.add_argument("--num-requests", type=int, default=384, help="requests in all (default 384)")
    p.add_argument("--min-tokens", type=int, default=16, help="fewest output tokens of a request (default 16)")
    p.add_argument("--max-tokens", type=int, default=64, help="most output tokens of a request (default 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="model directory for the tokenizer and config (default: SmolLM2)")
    p.add_argument("--out", type=Path, default=None, help="also write the result JSON here")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the dated result JSON goes")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from common import log as logsetup
    from llmserve.cli.configs import cache_root
    from llmserve.model_prep import prepare_default_model

    logsetup.configure()
    model = Path(args.model) if args.model else prepare_default_model(cache_root())
    now = dt.datetime.now()
    result = {
        "benchmark": "unequal_groups",
        "date": now.isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "args": {k: v for k, v in vars(args).items() if k not in ("out", "results_dir")},
        **run(args, model),
    }
    print(f"{'phase':<12}{'group':<6}{'cost':>6}{'steps':>8}{'tokens':>9}{'share':>8}{'busy':>8}")
    for phase in ("closed_loop", "burst"):
        for name, g in result[phase]["groups"].items():
            print(
                f"{phase:<12}{name:<6}{g['cost']:>6.1f}{g['steps']:>8}{g['sampled_tokens']:>9}"
                f"{100 * g['token_share']:>7.1f}%{100 * g['busy_share_of_wall']:>7.1f}%"
            )
        r = result[phase]
        print(f"{phase:<12}{r['tokens']} tokens in {r['wall_s']:.2f} s: {r['output_tokens_per_s']:.1f} tok/s")
    write_result(result, "unequal-groups", args, now)


if __name__ == "__main__":
    main()
