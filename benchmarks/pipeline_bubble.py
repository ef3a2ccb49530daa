"""How long each stage of a pipeline sits idle, with one plan in flight and with micro-batches.

Stand-in stages (the real Worker service and servicer, joined into a real gloo world by
worker_svc/device/pipeline.py, passing hidden states stage to stage over its point-to-point
sends) serve the real scheduler process as one pipelined group. A stage's step is a sleep of
--layer-ms per layer it holds plus --token-ms per token and layer (as a decoder layer's time
grows with its rows); the GIL is free meanwhile, so each stage has a core to itself as far as
its compute goes. Every request is sent at once (16-token prompts, --max-tokens out, greedy),
so the running batch fills to --num-seqs. Each stage logs when its compute starts and ends;
its idle share is the part of the steady window (the middle 80% of the run) it did not compute.

Runs, each a fresh group:
    1               even split: the stages take turns, each idles (stages - 1) / stages
    N               even split, one plan per stage in flight: the first stage waits for the
                    scheduler's turn-around (apply the oldest result, plan, send) every cycle
    N + 1           even split, one plan more (the scheduler's default), which covers it
    slow, even      one stage --slowdown times slower, even split, N + 1 micro-batches
    slow, auto      the same, with --pp-layer-split auto's rule: each stage times a layer, and
                    the split evens their step times (worker_svc/device/stage_probe.py)

Targets: with micro-batches each stage idles at most 15% of the window (on a machine with a
core per stage); with the auto split the stages' compute per step ends within 20% of each other.

    python benchmarks/pipeline_bubble.py
    python benchmarks/pipeline_bubble.py --stages 3 --layers 12

The result JSON goes to benchmarks/results/pipeline-bubble-<YYYYmmdd-HHMMSS>.json (and --out).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make the packages importable without install
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.step_overlap import _drive, _free_port, _wait_ready, serve_runner, write_result  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
HIDDEN = 64  # width of the stand-in hidden states passed stage to stage


# ---- a stand-in stage (a process of its own: `--stage R`) ----


class SleepingStage:
    """What the servicer needs of a ModelRunner, for one pipeline stage: receive the previous
    stage's hidden states, sleep for its layers, send them on; the last stage samples a token
    that depends on the fed token and its position."""

    def __init__(self, args: argparse.Namespace, vocab_size: int, max_model_len: int) -> None:
        import torch

        from common.config import WorkerConfig
        from worker_svc.device import pipeline

        n, rank = args.stages, args.stage
        cost = args.slowdown if rank == args.slow_stage else 1.0
        self.layer_s, self.token_s = args.layer_ms * cost / 1e3, args.token_ms * cost / 1e3
        self.config = WorkerConfig(
            model=Path(args.model).name, rank=rank, world_size=n, pipeline_stages=n, dist_init_method=args.init
        )
        self.device = torch.device("cpu")
        self.vocab_size, self.max_model_len, self.num_layers = vocab_size, max_model_len, args.layers
        split = tuple(int(c) for c in args.split.split(",")) if args.split not in ("", "auto") else ()
        _, self.stage = pipeline.join(
            rank,
            n,
            n,
            args.layers,
            args.init,
            self.device,
            60.0,
            "gloo",
            split,
            self._measured_split if args.split == "auto" else None,
        )
        self.log: list[tuple[int, int, float, float]] = []  # (step, tokens, compute start, compute end)

    def _measured_split(self, stage: int) -> tuple[int, ...]:
        """--pp-layer-split auto's rule over stand-in layers: time one, exchange, split."""
        from worker_svc.device.stage_probe import StageProbe, auto_split, exchange

        start = time.perf_counter()
        for _ in range(5):
            time.sleep(self.layer_s + self.token_s * 128)  # a layer at stage_probe's 128 rows
        mine = StageProbe((time.perf_counter() - start) / 5, 0.0, 1 << 40)
        return auto_split(exchange(mine, self.config.pipeline_stages, 1), self.num_layers, 1)

    def info(self, model_name: str) -> Any:
        from common.worker_info import WorkerInfo

        n = self.config.pipeline_stages
        return WorkerInfo(
            model_name, self.vocab_size, self.max_model_len, "bfloat16", "standin", self.config.rank, n, 16, 16384, 0, 1,
            pipeline_stages=n,
        )  # fmt: skip

    def execute(self, plan: Any) -> Any:
        import torch

        from common.plan import StepResult

        start = time.perf_counter()
        rows = int(plan.num_tokens)
        if self.stage.is_first:
            x = torch.zeros(rows, HIDDEN)
        else:
            x = self.stage.recv_hidden(rows, HIDDEN, torch.float32, self.device)[0]
        compute = time.perf_counter()
        time.sleep(len(self.stage.layers) * (self.layer_s + self.token_s * rows))
        done = time.perf_counter()
        self.log.append((plan.step_id, rows, compute, done))
        tokens = np.full(plan.num_seqs, -1, np.int32)
        if not self.stage.is_last:
            self.stage.send_hidden(x, x)
        elif plan.num_seqs:
            fed = plan.input_ids[np.cumsum(plan.query_lens) - 1].astype(np.int64)
            positions = (plan.context_lens + plan.query_lens).astype(np.int64)
            drawn = 100 + (fed * 31 + positions * 7) % (self.vocab_size - 100)
            tokens = np.where(plan.sample == 1, drawn, -1).astype(np.int32)
        return StepResult(plan.step_id, tokens, done - start, logprobs=np.zeros(plan.num_seqs, np.float32))


async def _serve_stage(args: argparse.Namespace) -> None:
    config = json.loads((Path(args.model) / "config.json").read_text())
    runner = SleepingStage(args, int(config["vocab_size"]), int(config["max_position_embeddings"]))
    await serve_runner(
        runner,
        runner.config.model,
        args.listen,
        args.log,
        lambda: {"layers": len(runner.stage.layers), "steps": runner.log},
    )


# ---- the run ----


def run_mode(args: argparse.Namespace, model: Path, micro_batches: int, slow: bool, split: str) -> dict[str, Any]:
    n = args.stages
    ports, port = [_free_port() for _ in range(n)], _free_port()
    init = f"tcp://127.0.0.1:{_free_port()}"
    with tempfile.TemporaryDirectory(prefix="llmserve-bubble-") as tmp:
        logs = [Path(tmp) / f"stage{r}.json" for r in range(n)]
        stages = []
        for r in range(n):
            cmd = [sys.executable, __file__, "--stage", str(r), "--stages", str(n), "--layers", str(args.layers)]
            cmd += ["--model", str(model), "--listen", f"127.0.0.1:{ports[r]}", "--init", init, "--log", str(logs[r])]
            cmd += ["--layer-ms", str(args.layer_ms), "--token-ms", str(args.token_ms), "--split", split]
            cmd += ["--slowdown", str(args.slowdown), "--slow-stage", str(n - 1 if slow else -1)]
            stages.append(subprocess.Popen(cmd, cwd=REPO_ROOT))
        cmd = [sys.executable, "-m", "llmserve.cli", "--log-level", "warning", "scheduler", "--model", str(model)]
        cmd += ["--worker", ",".join(f"127.0.0.1:{p}" for p in ports), "--port", str(port)]
        cmd += ["--max-num-seqs", str(args.num_seqs), "--pp-microbatches", str(micro_batches)]
        scheduler = subprocess.Popen(cmd, cwd=REPO_ROOT)
        procs = [scheduler, *stages]
        try:
            asyncio.run(_wait_ready(port, *procs))
            start = time.perf_counter()
            asyncio.run(_drive(port, args.num_seqs, args.max_tokens))
            end = time.perf_counter()
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        ran = [json.loads(path.read_text()) for path in logs]
    # The steady window: the middle 80% of the run (the batch fills at the start, drains at the end).
    lo, hi = start + 0.1 * (end - start), end - 0.1 * (end - start)
    per_stage = []
    for r, log in enumerate(ran):
        busy = sum(max(0.0, min(e, hi) - max(s, lo)) for _, _, s, e in log["steps"])
        inside = [e - s for _, _, s, e in log["steps"] if lo <= s < hi]
        per_stage.append(
            {
                "stage": r,
                "layers": log["layers"],
                "cost": args.slowdown if slow and r == n - 1 else 1.0,
                "steps": len(inside),
                "compute_ms_per_step": 1e3 * float(np.mean(inside)) if inside else 0.0,
                "idle_share": 1.0 - busy / (hi - lo),
            }
        )
    times = [s["compute_ms_per_step"] for s in per_stage]
    return {
        "micro_batches": micro_batches,
        "split": split or "even",
        "slow_stage": n - 1 if slow else None,
        "wall_s": end - start,
        "output_tokens_per_s": args.num_seqs * args.max_tokens / (end - start),
        "stages": per_stage,
        "max_idle_share": max(s["idle_share"] for s in per_stage),
        "compute_spread": max(times) / min(times) if min(times) > 0 else float("inf"),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, default=2, help="pipeline stages (default 2, a core each here)")
    p.add_argument("--layers", type=int, default=12, help="stand-in decoder layers (default 12)")
    p.add_argument("--layer-ms", type=float, default=1.0, help="a layer's fixed time per step (default 1)")
    p.add_argument("--token-ms", type=float, default=0.02, help="a layer's time per token in the step (default 0.02)")
    p.add_argument(
        "--micro-batches", type=int, default=0, help="plans in flight in the slow-stage runs (default: stages + 1)"
    )
    p.add_argument("--slowdown", type=float, default=2.0, help="how much slower the slow stage is (default 2)")
    p.add_argument("--num-seqs", type=int, default=64, help="requests, all in flight at once (default 64)")
    p.add_argument("--max-tokens", type=int, default=96, help="output tokens per request (default 96)")
    p.add_argument("--model", default=None, help="model directory for the tokenizer and config (default: SmolLM2)")
    p.add_argument("--out", type=Path, default=None, help="also write the result JSON here")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the dated result JSON goes")
    for hidden in ("--stage", "--slow-stage"):
        p.add_argument(hidden, type=int, default=None, help=argparse.SUPPRESS)
    for hidden in ("--listen", "--init", "--log", "--split"):
        p.add_argument(hidden, default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.stage is not None:
        asyncio.run(_serve_stage(args))
        return
    from common import log as logsetup
    from llmserve.cli.configs import cache_root
    from llmserve.model_prep import prepare_default_model

    logsetup.configure()
    model = Path(args.model) if args.model else prepare_default_model(cache_root())
    n, mb = args.stages, args.micro_batches or args.stages + 1
    modes = [
        run_mode(args, model, 1, slow=False, split=""),
        run_mode(args, model, n, slow=False, split=""),
        run_mode(args, model, n + 1, slow=False, split=""),
        run_mode(args, model, mb, slow=True, split=""),
        run_mode(args, model, mb, slow=True, split="auto"),
    ]
    now = dt.datetime.now()
    result = {
        "benchmark": "pipeline_bubble",
        "date": now.isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "args": {
            k: getattr(args, k)
            for k in ("stages", "layers", "layer_ms", "token_ms", "slowdown", "num_seqs", "max_tokens")
        },
        "modes": modes,
    }
    print(f"{'micro-batches':<14}{'split':<12}{'tok/s':>8}  per stage: layers, compute ms/step, idle share")
    for m in modes:
        split = f"{m['split']}{' slow' if m['slow_stage'] is not None else ''}"
        cells = "  ".join(
            f"{s['layers']:>2}L {s['compute_ms_per_step']:6.2f}ms {100 * s['idle_share']:5.1f}%" for s in m["stages"]
        )
        print(f"{m['micro_batches']:<14}{split:<12}{m['output_tokens_per_s']:>8.0f}  {cells}")
    write_result(result, "pipeline-bubble", args, now)


if __name__ == "__main__":
    main()
