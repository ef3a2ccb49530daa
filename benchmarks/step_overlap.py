"""How long a worker waits for the scheduler between two steps, planning ahead or not.

A stand-in worker (the real Worker service and servicer, with a runner that sleeps a fixed
time per step instead of computing, as a GPU decode step would take) serves the real scheduler
process; every request is sent at once over gRPC, so the running batch fills to
--max-num-seqs. The stand-in logs when each step starts and ends; the idle time of a step is
the gap between the end of the step before it and its start. Both modes run in turn:

    ahead   the scheduler plans step N+1 while step N runs (the default)
    sync    --no-plan-ahead: it plans N+1 when N's result is back

    python benchmarks/step_overlap.py                     # 256 sequences, 10 ms steps
    python benchmarks/step_overlap.py --num-seqs 64 --step-ms 5

Target: at 256 running sequences the worker is idle at most 5 % of a step. The result JSON
goes to benchmarks/results/step-overlap-<YYYYmmdd-HHMMSS>.json (and --out).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make `common` importable without install
    sys.path.insert(0, str(REPO_ROOT))

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- the stand-in worker (a process of its own: `--standin`) ----


class SleepingRunner:
    """What the servicer needs of a ModelRunner; a step is `step_s` of sleep, plus `token_s` per
    token in it (the GIL is free, as it is while a GPU computes). Tokens depend on the fed token
    and its position; deferred inputs are filled from the last step's samples, as the real
    runner does."""

    def __init__(
        self, model_name: str, vocab_size: int, max_model_len: int, step_s: float, token_s: float = 0.0
    ) -> None:
        import torch

        from common.config import WorkerConfig
        from worker_svc.device.parallel import SINGLE

        self.config = WorkerConfig(model=model_name)
        self.group = SINGLE
        self.device = torch.device("cpu")  # the servicer binds its forward thread to it
        self.model_name, self.vocab_size, self.max_model_len, self.step_s = (
            model_name,
            vocab_size,
            max_model_len,
            step_s,
        )
        self.token_s = token_s
        self.last: dict[int, int] = {}
        self.log: list[tuple[int, float, float, int]] = []  # (sequences, start, end, sampled) per step

    def info(self, model_name: str) -> Any:
        from common.worker_info import WorkerInfo

        return WorkerInfo(model_name, self.vocab_size, self.max_model_len, "bfloat16", "standin", 0, 1, 16, 16384, 0, 1)

    def execute(self, plan: Any) -> Any:
        from common.plan import DEFERRED_INPUT, StepResult

        start = time.perf_counter()
        ends = np.cumsum(plan.query_lens)
        fed = plan.input_ids[ends - 1].astype(np.int64) if plan.num_seqs else np.zeros(0, np.int64)
        for i in np.flatnonzero(fed == DEFERRED_INPUT):
            fed[i] = self.last[int(plan.seq_ids[i])]
        positions = (plan.context_lens + plan.query_lens).astype(np.int64)
        tokens = np.where(plan.sample == 1, 100 + (fed * 31 + positions * 7) % (self.vocab_size - 100), -1).astype(
            np.int32
        )
        rows = np.flatnonzero(plan.sample)
        self.last = dict(zip(plan.seq_ids[rows].tolist(), tokens[rows].tolist()))
        remaining = self.step_s + self.token_s * int(plan.num_tokens) - (time.perf_counter() - start)
        if remaining > 0:
            time.sleep(remaining)
        end = time.perf_counter()
        self.log.append((plan.num_seqs, start, end, len(rows)))
        return StepResult(plan.step_id, tokens, end - start, logprobs=np.zeros(plan.num_seqs, np.float32))


async def serve_runner(runner: Any, model_name: str, listen: str, log_path: str, log: Any) -> None:
    """The real Worker service over a stand-in runner, until SIGTERM; then `log` (what the
    runner recorded) goes to `log_path` as JSON."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from common.pb.llmserve.v1 import worker_pb2_grpc
    from worker_svc.service.servicer import WorkerServicer

    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 256 << 20)])
    servicer = WorkerServicer(runner, model_name)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(listen)
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    Path(log_path).write_text(json.dumps(log()))
    await server.stop(0)
    servicer.shutdown()


def write_result(result: dict[str, Any], name: str, args: argparse.Namespace, now: dt.datetime) -> None:
    """The result JSON, dated, into --results-dir (and to --out)."""
    args.results_dir.mkdir(parents=True, exist_ok=True)
    for path in [args.results_dir / f"{name}-{now.strftime('%Y%m%d-%H%M%S')}.json"] + ([args.out] if args.out else []):
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")


async def _serve_standin(args: argparse.Namespace) -> None:
    config = json.loads((Path(args.model) / "config.json").read_text())
    runner = SleepingRunner(
        Path(args.model).name,
        int(config["vocab_size"]),
        int(config["max_position_embeddings"]),
        args.step_ms / 1e3,
        args.token_ms / 1e3,
    )
    await serve_runner(runner, runner.model_name, args.listen, args.log, lambda: runner.log)


# ---- the run ----


async def _drive(port: int, num_seqs: int, max_tokens: int) -> float:
    import grpc

    from common.pb.llmserve.v1 import generation_pb2 as pb
    from common.pb.llmserve.v1 import generation_pb2_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one(i: int) -> int:
            request = pb.GenerateRequest(
                prompt_token_ids=[200 + (i * 13 + k) % 1000 for k in range(16)],
                sampling=pb.SamplingParams(temperature=0.0),
                stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
            )
            return sum([len(m.token_ids) async for m in stub.Generate(request)])

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(num_seqs)))
        if sum(counts) != num_seqs * max_tokens:
            raise RuntimeError(f"streamed {sum(counts)} tokens, expected {num_seqs * max_tokens}")
        return time.perf_counter() - start


async def _wait_ready(port: int, *procs: subprocess.Popen[bytes]) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for _ in range(600):
            for proc in procs:  # the scheduler, and the stand-in it waits for
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.args[1:3]} exited with {proc.returncode}")
            try:
                if (
                    await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                ).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError("scheduler not serving")


def run_mode(args: argparse.Namespace, model: Path, plan_ahead: bool) -> dict[str, Any]:
    worker_port, port = _free_port(), _free_port()
    with tempfile.TemporaryDirectory(prefix="llmserve-overlap-") as tmp:
        log_path = Path(tmp) / "steps.json"
        standin = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--standin",
                "--model",
                str(model),
                "--listen",
                f"127.0.0.1:{worker_port}",
                "--step-ms",
                str(args.step_ms),
                "--log",
                str(log_path),
            ],
            cwd=REPO_ROOT,
        )
        cmd = [
            sys.executable,
            "-m",
            "llmserve.cli",
            "--log-level",
            "warning",
            "scheduler",
            "--model",
            str(model),
            "--worker",
            f"127.0.0.1:{worker_port}",
            "--port",
            str(port),
            "--max-num-seqs",
            str(args.num_seqs),
        ]
        scheduler = subprocess.Popen(cmd + ([] if plan_ahead else ["--no-plan-ahead"]), cwd=REPO_ROOT)
        try:
            asyncio.run(_wait_ready(port, scheduler, standin))
            cpu_before = _cpu_seconds(scheduler.pid), time.process_time()
            wall = asyncio.run(_drive(port, args.num_seqs, args.max_tokens))
            scheduler_cpu, client_cpu = _cpu_seconds(scheduler.pid) - cpu_before[0], time.process_time() - cpu_before[1]
        finally:
            for proc in (scheduler, standin):
                proc.send_signal(signal.SIGTERM)
            for proc in (scheduler, standin):
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        steps = json.loads(log_path.read_text())
    full = [i for i in range(1, len(steps)) if steps[i][0] == args.num_seqs and steps[i - 1][0] == args.num_seqs]
    gaps = [steps[i][1] - steps[i - 1][2] for i in full]
    lengths = [steps[i][2] - steps[i][1] for i in full]
    if not gaps:
        sizes = sorted({n for n, _, _ in steps})
        raise RuntimeError(f"no two consecutive steps ran {args.num_seqs} sequences (step sizes: {sizes[-10:]})")
    return {
        "plan_ahead": plan_ahead,
        "wall_s": wall,
        # CPU the scheduler process and this process (the 256 streams' client) spent per step.
        "scheduler_cpu_ms_per_step": 1e3 * scheduler_cpu / len(steps),
        "client_cpu_ms_per_step": 1e3 * client_cpu / len(steps),
        "steps": len(steps),
        "steps_at_full_batch": len(full),
        "step_ms": {"mean": 1e3 * statistics.fmean(lengths)},
        "idle_ms": {
            "mean": 1e3 * statistics.fmean(gaps),
            "p50": 1e3 * float(np.percentile(gaps, 50)),
            "p99": 1e3 * float(np.percentile(gaps, 99)),
        },
        "idle_share_of_step": statistics.fmean(gaps) / statistics.fmean(lengths),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-seqs", type=int, default=256, help="requests in flight and the batch size (default 256)")
    p.add_argument("--step-ms", type=float, default=10.0, help="duration of a stand-in step (default 10)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request (default 128)")
    p.add_argument("--model", default=None, help="model directory for the tokenizer and config (default: SmolLM2)")
    p.add_argument("--out", type=Path, default=None, help="also write the result JSON here")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the dated result JSON goes")
    p.add_argument("--standin", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--listen", help=argparse.SUPPRESS)
    p.add_argument("--log", help=argparse.SUPPRESS)
    p.add_argument("--token-ms", type=float, default=0.0, help=argparse.SUPPRESS)  # a stand-in's cost per token
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.standin:
        asyncio.run(_serve_standin(args))
        return
    from common import log as logsetup
    from llmserve.cli.configs import cache_root
    from llmserve.model_prep import prepare_default_model

    logsetup.configure()
    model = Path(args.model) if args.model else prepare_default_model(cache_root())
    modes = [run_mode(args, model, plan_ahead) for plan_ahead in (True, False)]
    now = dt.datetime.now()
    result = {
        "benchmark": "step_overlap",
        "date": now.isoformat(timespec="seconds"),
        "num_seqs": args.num_seqs,
        "stand_in_step_ms": args.step_ms,
        "max_tokens": args.max_tokens,
        "cpu_count": os.cpu_count(),
        "modes": modes,
    }
    print(
        f"{'mode':<8}{'steps':>7}{'step ms':>9}{'idle ms':>9}{'p99 ms':>8}{'idle/step':>11}{'sched cpu':>11}{'client cpu':>12}"
    )
    for m in modes:
        print(
            f"{'ahead' if m['plan_ahead'] else 'sync':<8}{m['steps_at_full_batch']:>7}{m['step_ms']['mean']:>9.2f}"
            f"{m['idle_ms']['mean']:>9.3f}{m['idle_ms']['p99']:>8.3f}{100 * m['idle_share_of_step']:>10.1f}%"
            f"{m['scheduler_cpu_ms_per_step']:>9.2f}ms{m['client_cpu_ms_per_step']:>10.2f}ms"
        )
    write_result(result, "step-overlap", args, now)


if __name__ == "__main__":
    main()
