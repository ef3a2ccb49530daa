"""`llmserve up --tp 2` streams, greedy, what `--tp 1` streams: the real services, the rank
launcher and the collectives, end to end.

On CUDA both ranks share the one GPU a device machine has, over gloo (`--dist-backend gloo`:
NCCL refuses two ranks on one device); what this checks is the sharded model and the
collectives' plumbing on CUDA tensors, not NCCL. On a CPU (--smoke) it is the CPU tp path.
float32, so that the two reductions' different orders cannot flip a greedy choice; the model
is small and peaked (gpu_check.checkpoints.tp_model).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpu_check import checkpoints
from gpu_check.context import Context

REPO_ROOT = Path(__file__).resolve().parents[2]
NEW_TOKENS = 24
START_TIMEOUT_S = 300.0


def command(ctx: Context, model_dir: Path, port: int, tp: int) -> list[str]:
    args = [
        "--log-level",
        "warning",
        "up",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--tp",
        str(tp),
        "--device",
        ctx.device.type,  # `up` places each rank itself (rank r of a group on cuda:r, mod GPUs over gloo)
        "--dtype",
        "float32",
        "--no-http",
        "--num-gpu-blocks",
        "256",  # a fixed cache: two ranks profiling one GPU would each count the other's memory
        "--num-cpu-blocks",
        "0",
        "--max-num-seqs",
        "8",
    ]
    if tp > 1 and ctx.cuda:
        args += ["--dist-backend", "gloo"]
    return [sys.executable, "-m", "llmserve.cli", *args]


def run(ctx: Context) -> dict[str, Any]:
    model = ctx.shared("tp_model", lambda: checkpoints.tp_model(ctx.workdir / "tp-model", ctx.tiny))
    prompts = [[300 + 17 * i + j for j in range(8 + 24 * i)] for i in range(4)]
    commands = {tp: command(ctx, model, _free_port(), tp) for tp in (1, 2)}
    if ctx.dry:
        from llmserve.cli.parser import build_parser

        for cmd in commands.values():
            build_parser().parse_args(cmd[3:])  # the flags exist and take these values
        return {"commands": {str(tp): " ".join(cmd) for tp, cmd in commands.items()}, "summary": "commands parse"}
    outputs: dict[int, list[list[int]]] = {}
    seconds: dict[str, float] = {}
    for tp, cmd in commands.items():
        start = time.perf_counter()
        outputs[tp], seconds[f"tp{tp}_generate_s"] = _serve_and_generate(cmd, prompts)
        seconds[f"tp{tp}_total_s"] = time.perf_counter() - start
    same = sum(a == b for a, b in zip(outputs[1], outputs[2]))
    return {
        "dist_backend": "gloo",
        "device": ctx.device.type,
        "sequences_identical_tp2_vs_tp1": f"{same}/{len(prompts)}",
        **seconds,
        "passed": same == len(prompts),
        "summary": f"tp2 vs tp1 identical {same}/{len(prompts)} (gloo, {ctx.device.type})",
    }


def _serve_and_generate(cmd: list[str], prompts: list[list[int]]) -> tuple[list[list[int]], float]:
    from llmserve.client import LlmserveClient

    port = cmd[cmd.index("--port") + 1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env)
    try:
        _wait_serving(f"127.0.0.1:{port}", proc)
        with LlmserveClient(f"127.0.0.1:{port}") as client:
            start = time.perf_counter()
            outputs = [
                [
                    t
                    for m in client.generate(prompt_token_ids=p, max_tokens=NEW_TOKENS, ignore_eos=True)
                    for t in m.token_ids
                ]
                for p in prompts
            ]
            return outputs, time.perf_counter() - start
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait_serving(address: str, proc: subprocess.Popen[bytes]) -> None:
    """Until the service's health check says SERVING (its workers are ready)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + START_TIMEOUT_S
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass  # not listening yet
            if proc.poll() is not None:
                raise RuntimeError(f"llmserve up exited with {proc.returncode} before serving")
            if time.monotonic() > deadline:
                raise RuntimeError(f"not serving after {START_TIMEOUT_S:.0f} s")
            time.sleep(1)
