"""`llmserve worker`, and the worker command line that `up`, `worker --tp N` and the offline
`LLM` start their worker processes with.

A worker keeps every forward pass on its main thread and runs its gRPC event loop beside it
(worker_svc/service/main_thread.py's `run_beside`); with `--tp N` and no --rank, this process
only starts and supervises the N rank processes.

The worker token (--worker-token-file, or LLMSERVE_WORKER_TOKEN, which is how `up`, the
offline LLM and `worker --tp N` hand it to the processes they start: never on a command line,
which any user of the host can read) guards Describe and Execute and is shown on Register.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

from common.config import AuthConfig
from llmserve.cli import configs
from llmserve.cli.commands import serve
from llmserve.cli.speculative_flags import draft_model_dir
from llmserve.supervisor import exit_with_parent


def worker_args(a: argparse.Namespace, model: str) -> list[str]:
    """The worker command line (without --listen) that carries this invocation's worker flags."""
    cmd = [
        sys.executable,
        "-m",
        "llmserve.cli",
        "--log-level",
        a.log_level,
        "worker",
        "--model",
        model,
        "--dtype",
        a.dtype,
        "--device",
        a.device,
        "--block-size",
        str(a.block_size),
        "--max-model-len",
        str(a.max_model_len),
        "--attention-backend",
        a.attention_backend,
        "--max-num-batched-tokens",
        str(a.max_num_batched_tokens),
        "--max-num-seqs",
        str(a.max_num_seqs),
        "--dist-timeout",
        str(a.dist_timeout),
        "--dist-backend",
        a.dist_backend,
        "--gpu-memory-utilization",
        str(a.gpu_memory_utilization),
        "--pp",
        str(a.pp),
    ]
    if a.pp_layer_split:
        cmd += ["--pp-layer-split", a.pp_layer_split]
    for flag, value in (
        ("--num-gpu-blocks", a.num_gpu_blocks),
        ("--kv-cache-gb", a.kv_cache_gb),
        ("--swap-space-gb", a.swap_space_gb),
        ("--num-cpu-blocks", a.num_cpu_blocks),
    ):
        if value is not None:
            cmd += [flag, str(value)]
    if a.no_reflection:
        cmd += ["--no-reflection"]
    draft = draft_model_dir(a)
    if draft:
        cmd += ["--speculative-model", draft]
    if a.profile_steps:
        cmd += ["--profile-steps"]
    if a.enforce_eager:
        cmd += ["--enforce-eager"]
    if configs.lora_enabled(a):
        cmd += ["--enable-lora", "--max-lora-rank", str(a.max_lora_rank), "--max-loras", str(a.max_loras)]
        if a.max_cpu_loras is not None:
            cmd += ["--max-cpu-loras", str(a.max_cpu_loras)]
    return cmd


def _run_rank_launcher(a: argparse.Namespace, model: str) -> None:
    """`worker --tp N --pp M`: start the N x M ranks, end them all when one ends (or on SIGTERM)."""
    from llmserve.rank_launcher import RankLauncher

    configs.check_tp(model, a.tp)
    configs.check_pp(model, a.pp, a.pp_layer_split)
    cmd = worker_args(a, model)
    for flag in (
        "--tls-cert",
        "--tls-key",
        "--tls-client-ca",
        "--scheduler-tls-ca",
        "--scheduler-tls-cert",
        "--scheduler-tls-key",
        "--scheduler-tls-server-name",
    ):
        value = getattr(a, flag.removeprefix("--").replace("-", "_"), None)
        if value:
            cmd += [flag, value]
    if a.scheduler:
        # Every rank registers itself; the group is named after rank 0's address.
        cmd += ["--scheduler", a.scheduler, "--group", a.advertise or a.listen]
    token = configs.worker_token(a)
    env = {**os.environ, configs.WORKER_TOKEN_ENV: token} if token is not None else None
    group = RankLauncher(cmd, a.listen, a.tp * a.pp, metrics_port=a.metrics_port, advertise=a.advertise, env=env)
    stopping = {"now": False}

    def request_stop(*_: object) -> None:
        stopping["now"] = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, request_stop)
    group.start()
    sys.exit(group.wait(lambda: stopping["now"]))


def cmd_worker(a: argparse.Namespace) -> None:
    from worker_svc.service.server import WorkerServer

    if a.parent_pid is not None:
        exit_with_parent(a.parent_pid)
    if a.tp * a.pp > 1 and a.rank is None:
        _run_rank_launcher(a, configs.model_dir(a.model))
        return
    from worker_svc.service.main_thread import MainThreadExecutor, run_beside

    tls = configs.tls_config(a)
    model = configs.model_dir(a.model)
    token = configs.worker_token(a)
    # The model loads on this thread and every step runs on it (worker_svc/service/main_thread.py).
    steps = MainThreadExecutor()
    server = WorkerServer(
        configs.worker_config(a, model),
        a.listen,
        tls=tls,
        reflection=not a.no_reflection,
        metrics_port=a.metrics_port,
        registrar=_registrar(a, model, token),
        executor=steps,
        auth=AuthConfig(worker_token=token),
    )
    run_beside(steps, lambda stop: serve(server, stop))
    sys.exit(server.exit_code)


def _registrar(a: argparse.Namespace, model: str, token: str | None) -> Any:
    """With --scheduler: how this rank registers (its advertised address, group and rank)."""
    if not a.scheduler:
        return None
    from worker_svc.service.registration import Registrar

    address = a.advertise or a.listen
    host = address.rpartition(":")[0]
    if host in ("0.0.0.0", "[::]", ""):
        raise ValueError(f"--listen {a.listen} is not an address the scheduler can dial: give --advertise HOST:PORT")
    return Registrar(
        scheduler=a.scheduler,
        address=address,
        group=a.group or address,
        rank=a.rank or 0,
        world_size=a.world_size or 1,
        model_name=Path(model).name,
        block_size=a.block_size,
        tls=configs.client_tls_config(a, "scheduler"),
        token=token,
    )
