"""Chaos soak: mixed load on several worker groups while their processes are killed, frozen,
stopped and restarted at random.

    python benchmarks/chaos.py                          # 10 minutes on SmolLM2, 3 workers
    python benchmarks/chaos.py --model DIR --seconds 30  # any model, a short run

A scheduler and --workers registering CPU workers (float32, small KV pools so that requests
preempt each other), each a process of its own. Clients keep --concurrency requests in flight,
drawn from a fixed pool of greedy and seeded prompts whose undisturbed outputs are recorded
first; a request streams normally, or is cancelled after a few tokens, or has a short
deadline, or asks for n = 2 seeded samples, or asks for a structured output (a bounded JSON
schema, seeded sampling at temperature 1). Meanwhile, every --chaos-interval seconds, one
worker is SIGKILLed (and restarted), SIGSTOPped for a while (then SIGCONT), or SIGTERMed (and
restarted).

Every request must end with exactly its undisturbed tokens, or with a documented status
(ABORTED or UNAVAILABLE for a lost worker, CANCELLED or DEADLINE_EXCEEDED when the client
asked for it, RESOURCE_EXHAUSTED for a full queue), having streamed a prefix of those tokens.
A structured output that finishes must also end with finish reason STOP, and its text must
parse as JSON and validate against its schema (jsonschema). At the end every KV block must be free, and the scheduler's resident memory is reported over
the run. Writes benchmarks/results/chaos-<YYYYmmdd-HHMMSS>.json; exit 1 if any check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime as dt
import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema
import structlog
from tqdm import tqdm

BENCH_DIR = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH_DIR), str(BENCH_DIR.parent)]

from recovery_bench import Cluster  # noqa: E402
from throughput import RESULTS_DIR, _vocab_size, _wait_serving, machine, make_workload  # noqa: E402

from benchmarks.prometheus_scrape import summed  # noqa: E402
from common import log as logsetup  # noqa: E402

log = structlog.get_logger("benchmark")

DOCUMENTED = {"ABORTED", "UNAVAILABLE", "CANCELLED", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"}
# Modes of a request and how often each is drawn.
MODES = (("stream", 0.45), ("cancel", 0.15), ("deadline", 0.15), ("samples", 0.15), ("structured", 0.10))
# The structured kind's schemas: each output is short whatever the model writes (bounded
# integers, enums, short strings and arrays), so it completes well within STRUCTURED_MAX_TOKENS.
SCHEMAS: list[dict[str, Any]] = [
    {"type": "boolean"},
    {"type": "integer", "minimum": 0, "maximum": 99},
    {"enum": ["red", "green", "blue"]},
    {"type": "string", "pattern": "^[a-z]{2,4}$"},
    {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green"]}, "shade": {"type": "integer", "minimum": 1, "maximum": 3}},
        "required": ["color", "shade"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 9},
                    "y": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "required": ["point"],
        "additionalProperties": False,
    },
]
STRUCTURED_MAX_TOKENS = 96


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: the prepared SmolLM2-135M-Instruct)")
    p.add_argument("--seconds", type=float, default=600.0, help="how long the chaos lasts (default 10 minutes)")
    p.add_argument("--workers", type=int, default=3, help="registering worker processes (default 3)")
    p.add_argument("--concurrency", type=int, default=24, help="requests kept in flight (default 24)")
    p.add_argument("--pool", type=int, default=16, help="distinct prompts the requests are drawn from (default 16)")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per request (default 48)")
    p.add_argument("--gpu-blocks", type=int, default=48, help="KV blocks per worker: small, so requests preempt")
    p.add_argument("--chaos-interval", type=float, default=8.0, help="seconds between two disruptions (default 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="also write the result JSON here")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the JSON and the processes' logs go")
    return p.parse_args(argv)


class ChaosCluster(Cluster):
    """recovery_bench's cluster with small KV pools (so requests preempt), room for n = 2,
    and the readings the soak checks."""

    def __init__(self, model: str, args: argparse.Namespace, logs: Path) -> None:
        blocks = str(args.gpu_blocks)
        super().__init__(
            model,
            logs,
            args.workers,
            scheduler_flags=("--max-n", "4"),
            worker_flags=("--num-gpu-blocks", blocks, "--num-cpu-blocks", blocks),
        )

    def metrics(self) -> dict[str, float]:
        """The scheduler's unlabelled-by-group gauges and counters, summed over label sets."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        return collections.defaultdict(
            float, summed(url, lambda s: s.name if s.name.startswith("llmserve:") else None, timeout=5)
        )

    def scheduler_rss_mib(self) -> float:
        assert self.scheduler.proc is not None
        for line in Path(f"/proc/{self.scheduler.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0


class Chaos:
    """Disrupts one worker at a time: kill, freeze or stop it, then bring it back."""

    def __init__(self, cluster: ChaosCluster, rng: random.Random, interval: float) -> None:
        self.cluster, self.rng, self.interval = cluster, rng, interval
        self.actions: collections.Counter[str] = collections.Counter()

    async def run(self, until: float) -> None:
        while time.monotonic() + self.interval < until:
            await asyncio.sleep(self.interval * self.rng.uniform(0.5, 1.5))
            worker = self.rng.choice(self.cluster.workers)
            proc = worker.proc
            if proc is None or proc.poll() is not None:
                continue
            action = self.rng.choice(("kill", "freeze", "terminate"))
            self.actions[action] += 1
            log.info("chaos", action=action, pid=proc.pid)
            if action == "freeze":
                os.kill(proc.pid, signal.SIGSTOP)
                await asyncio.sleep(self.rng.uniform(2.0, 6.0))
                os.kill(proc.pid, signal.SIGCONT)
                continue
            proc.send_signal(signal.SIGKILL if action == "kill" else signal.SIGTERM)
            await asyncio.to_thread(proc.wait, 60)
            await asyncio.sleep(self.rng.uniform(0.5, 3.0))
            worker.proc = None
            worker.start()
            self.actions["restart"] += 1


class Load:
    """Keeps `concurrency` requests in flight and checks how each one ends."""

    def __init__(self, stub: Any, pool: list[dict[str, Any]], rng: random.Random) -> None:
        self.stub, self.pool, self.rng = stub, pool, rng
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.failures: list[str] = []
        self.tokens = 0

    async def one(self) -> None:
        import grpc

        item = self.rng.choice(self.pool)
        mode = self.rng.choices([m for m, _ in MODES], [w for _, w in MODES])[0]
        kind = mode if mode in ("samples", "structured") else "greedy"
        request = item[kind]
        expected: list[list[int]] = item[f"expected_{kind}"]
        got: list[list[int]] = [[] for _ in expected]
        text = ""
        finish = 0
        cancel_after = self.rng.randint(1, 8) if mode == "cancel" else None
        timeout = self.rng.uniform(0.3, 3.0) if mode == "deadline" else None
        call = self.stub.Generate(request, timeout=timeout)
        code = "OK"
        try:
            async for message in call:
                got[message.index].extend(message.token_ids)
                text += message.text
                finish = message.finish_reason or finish
                self.tokens += len(message.token_ids)
                if cancel_after is not None and sum(map(len, got)) >= cancel_after:
                    call.cancel()
                    break
        except grpc.aio.AioRpcError as error:
            code = error.code().name
        except asyncio.CancelledError:
            code = "CANCELLED"
        if cancel_after is not None and code == "OK" and sum(map(len, got)) >= cancel_after:
            code = "CANCELLED"
        self.outcomes[f"{mode}:{code}"] += 1
        if code == "OK":
            if got != expected:
                self.failures.append(f"{mode}: streamed tokens differ from the undisturbed run")
            elif mode == "structured" and (problem := _invalid(text, finish, item["schema"])):
                self.failures.append(f"structured: finished, but {problem}")
        elif code not in DOCUMENTED:
            self.failures.append(f"{mode}: undocumented status {code}")
        elif any(g != e[: len(g)] for g, e in zip(got, expected)):
            self.failures.append(f"{mode}: ended {code} after tokens that are not a prefix of the undisturbed run")

    async def run(self, until: float, concurrency: int) -> None:
        async def client() -> None:
            while time.monotonic() < until:
                await self.one()

        await asyncio.gather(*(client() for _ in range(concurrency)))


def _invalid(text: str, finish: int, schema: dict[str, Any]) -> str | None:
    """Why a finished structured output is wrong (None if it is right): it must have ended
    because its grammar was complete, and its text must validate against its schema."""
    from common.pb.llmserve.v1 import generation_pb2 as pb

    if finish != pb.FINISH_REASON_STOP:
        return f"with finish reason {pb.FinishReason.Name(finish)}, not STOP: {text!r}"
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError) as error:
        return f"its text {text!r} does not validate: {str(error).splitlines()[0]}"
    return None


async def _undisturbed(stub: Any, request: Any, n: int, schema: dict[str, Any] | None = None) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(n)]
    text, finish = "", 0
    async for message in stub.Generate(request):
        out[message.index].extend(message.token_ids)
        text += message.text
        finish = message.finish_reason or finish
    if schema is not None and (problem := _invalid(text, finish, schema)):
        raise RuntimeError(f"undisturbed structured output for {json.dumps(schema)}: {problem}")
    return out


async def _wait_for_groups(stub: Any, count: int, timeout: float = 120.0) -> None:
    """Until `count` worker groups are ready. While none is, GetLoad itself is UNAVAILABLE
    (every worker down or restarting at once, as chaos leaves them at times)."""
    import grpc

    from common.pb.llmserve.v1 import generation_pb2 as pb

    deadline = time.monotonic() + timeout
    while True:
        try:
            if len((await stub.GetLoad(pb.GetLoadRequest())).groups) >= count:
                return
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE:
                raise
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {count} worker groups ready after {timeout:.0f} s")
        await asyncio.sleep(0.2)


async def _run(args: argparse.Namespace, model: str, stamp: str) -> dict[str, Any]:
    import grpc

    from common.pb.llmserve.v1 import generation_pb2 as pb
    from common.pb.llmserve.v1 import generation_pb2_grpc

    rng = random.Random(args.seed)
    prompts = make_workload(args.pool, args.seed, _vocab_size(Path(model)), prompt_len=(8, 96), output_len=(1, 1))
    stopping = pb.StoppingCriteria(max_tokens=args.max_tokens, ignore_eos=True)
    pool = [
        {
            "greedy": pb.GenerateRequest(prompt_token_ids=p, stopping=stopping),
            "samples": pb.GenerateRequest(
                prompt_token_ids=p,
                stopping=stopping,
                sampling=pb.SamplingParams(temperature=1.0, top_k=20, n=2, seed=1000 + i),
            ),
            # A text prompt, so that the output's text starts at a character boundary (random
            # ids may end inside a multi-byte character); the grammar's end stops it (STOP).
            "schema": SCHEMAS[i % len(SCHEMAS)],
            "structured": pb.GenerateRequest(
                prompt=f"Answer request {i} in the required JSON format:",
                stopping=pb.StoppingCriteria(max_tokens=STRUCTURED_MAX_TOKENS),
                sampling=pb.SamplingParams(temperature=1.0, seed=2000 + i),
                structured_output=pb.StructuredOutput(json_schema=json.dumps(SCHEMAS[i % len(SCHEMAS)])),
            ),
        }
        for i, (p, _) in enumerate(prompts)
    ]
    cluster = ChaosCluster(model, args, args.results_dir / f"chaos-{stamp}")
    cluster.start()
    rss: list[float] = []
    try:
        await _wait_serving(cluster.address, cluster.scheduler)
        async with grpc.aio.insecure_channel(cluster.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            await _wait_for_groups(stub, args.workers)
            for item in tqdm(pool, desc="undisturbed runs", unit="prompt", file=sys.stderr):
                item["expected_greedy"] = await _undisturbed(stub, item["greedy"], 1)
                item["expected_samples"] = await _undisturbed(stub, item["samples"], 2)
                item["expected_structured"] = await _undisturbed(stub, item["structured"], 1, item["schema"])
            rss.append(cluster.scheduler_rss_mib())
            start = time.monotonic()
            until = start + args.seconds
            load, chaos = Load(stub, pool, rng), Chaos(cluster, rng, args.chaos_interval)

            async def sample_memory() -> None:
                while time.monotonic() < until:
                    await asyncio.sleep(min(10.0, args.seconds / 4))
                    rss.append(cluster.scheduler_rss_mib())

            await asyncio.gather(load.run(until, args.concurrency), chaos.run(until), sample_memory())
            elapsed = time.monotonic() - start
            # Every worker back (none frozen or down), then every block free.
            await _wait_for_groups(stub, args.workers)
            deadline = time.monotonic() + 60
            while True:
                m = cluster.metrics()
                busy = {
                    k: m[f"llmserve:{k}"]
                    for k in (
                        "num_requests_running",
                        "num_requests_waiting",
                        "num_requests_swapped",
                        "kv_cache_usage_perc",
                        "cpu_cache_usage_perc",
                    )
                }
                if not any(busy.values()) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
            rss.append(cluster.scheduler_rss_mib())
    finally:
        cluster.stop()
    leaked = {k: v for k, v in busy.items() if v}
    requests = sum(load.outcomes.values())
    return {
        "seconds": round(elapsed, 1),
        "workers": args.workers,
        "concurrency": args.concurrency,
        "requests": requests,
        "tokens_streamed": load.tokens,
        "outcomes": dict(sorted(load.outcomes.items())),
        "disruptions": dict(chaos.actions),
        "preemptions": m["llmserve:num_preemptions_total"] or m["llmserve:num_preemptions"],
        "requests_recovered": m["llmserve:requests_recovered_total"] or m["llmserve:requests_recovered"],
        "failures": load.failures[:50],
        "num_failures": len(load.failures),
        "leaked_at_end": leaked,
        "scheduler_rss_mib": {"start": round(rss[0], 1), "end": round(rss[-1], 1), "max": round(max(rss), 1)},
        "ok": not load.failures and not leaked and requests > 0,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logsetup.configure("info")
    if args.model is None:
        from llmserve.cli.configs import cache_root
        from llmserve.model_prep import prepare_default_model

        model = str(prepare_default_model(cache_root()))
    else:
        model = args.model
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    result = {
        "benchmark": "chaos",
        "date": stamp,
        "model": Path(model).name,
        "machine": machine(),
        **asyncio.run(_run(args, model, stamp)),
    }
    args.results_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=2) + "\n"
    path = args.results_dir / f"chaos-{stamp}.json"
    path.write_text(text)
    if args.out is not None:
        args.out.write_text(text)
    print(
        json.dumps(
            {
                k: result[k]
                for k in (
                    "seconds",
                    "requests",
                    "outcomes",
                    "disruptions",
                    "preemptions",
                    "requests_recovered",
                    "num_failures",
                    "leaked_at_end",
                    "scheduler_rss_mib",
                    "ok",
                )
            },
            indent=2,
        )
    )
    print(f"wrote {path}")
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
