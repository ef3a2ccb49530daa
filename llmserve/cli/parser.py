"""`llmserve`: the entry point (the only place that reads flags and environment).

llmserve up          scheduler + one worker on this machine, OpenAI HTTP in front (what `make run` starts)
llmserve scheduler   the scheduler service alone, driving a worker at --worker
llmserve worker      one worker service alone
llmserve gateway     the OpenAI HTTP API (smg) over one or more running schedulers
llmserve generate    stream one generation from a running service to the terminal
llmserve prepare-model   download and convert the default model into the cache
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Coroutine
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from common import log as logsetup
from common.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    PREEMPTION_MODES,
    CacheConfig,
    LoraConfig,
    SchedulerConfig,
    ServerConfig,
    TlsClientConfig,
    TlsConfig,
    WorkerConfig,
)
from common.grpc.ports import check_free
from llmserve.gateway import (
    DEFAULT_HTTP_PORT,
    DEFAULT_METRICS_PORT,
    POLICIES,
    Gateway,
    GatewayConfig,
    KubernetesDiscovery,
    dial_address,
    smg_executable,
)
from llmserve.supervisor import Supervised, exit_with_parent

if TYPE_CHECKING:  # the worker's modules import torch: only `llmserve worker` loads them
    from worker_svc.service.main_thread import MainThreadExecutor

log = structlog.get_logger("llmserve")


# ---- flags ----


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=None, help="Hugging Face model directory (default: the prepared SmolLM2-135M-Instruct)"
    )


def _add_server_flags(p: argparse.ArgumentParser, port: int) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=port, help=f"gRPC port (default {port})")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus metrics port; 0 = off (default)")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds in-flight requests get to finish while new ones are refused (default 30)",
    )


def _add_security_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve TLS (needs --tls-key)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument(
        "--tls-client-ca",
        default=None,
        help="PEM CA bundle: require client certificates signed by it (mutual TLS; needs --tls-cert)",
    )
    p.add_argument("--no-reflection", action="store_true", help="do not serve gRPC reflection (health stays on)")


def _add_worker_tls_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--worker-tls-ca",
        default=None,
        help="PEM CA bundle the worker's certificate must chain to; any --worker-tls-* flag turns TLS to the worker on",
    )
    p.add_argument(
        "--worker-tls-cert", default=None, help="PEM client certificate for a worker that demands one (mutual TLS)"
    )
    p.add_argument("--worker-tls-key", default=None, help="PEM private key of --worker-tls-cert")
    p.add_argument(
        "--worker-tls-server-name",
        default=None,
        help="name the worker's certificate is checked against, when it differs from the --worker host",
    )


def _add_scheduler_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one step (default 256)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step (default 2048)")
    p.add_argument(
        "--max-queue-len",
        type=int,
        default=1024,
        help="waiting requests before new ones get RESOURCE_EXHAUSTED (default 1024)",
    )
    p.add_argument("--no-prefix-caching", action="store_true", help="do not reuse KV blocks of earlier prompts")
    p.add_argument(
        "--preemption-mode",
        choices=PREEMPTION_MODES,
        default="auto",
        help="how preempted requests give back KV blocks; auto = the cheaper of swap and recompute",
    )
    p.add_argument(
        "--swap-bandwidth-gbps",
        type=float,
        default=16.0,
        help="host<->device copy bandwidth the swap cost assumes, GB/s (default 16)",
    )
    p.add_argument(
        "--recompute-tokens-per-s",
        type=float,
        default=8000.0,
        help="prefill speed the recompute cost assumes, tokens/s (default 8000)",
    )
    p.add_argument("--max-prompt-tokens", type=int, default=0, help="longest prompt accepted; 0 = up to the context")
    p.add_argument("--max-stop-strings", type=int, default=16, help="most stop strings per request (default 16)")
    p.add_argument("--max-logprobs", type=int, default=20, help="most logprobs alternatives per token (default 20)")
    p.add_argument(
        "--max-n", type=int, default=16, help="most outputs, best_of candidates or beams per request (default 16)"
    )
    p.add_argument(
        "--no-plan-ahead",
        dest="plan_ahead",
        action="store_false",
        help="plan each step only after the previous step's result (default: plan it while that step runs)",
    )
    p.add_argument(
        "--json-max-whitespace",
        type=int,
        default=4,
        help="longest run of whitespace a JSON structured output may hold between tokens (default 4)",
    )
    _add_lora_flags(p)
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=DIR",
        help="LoRA adapters (PEFT directories) served from the start, by name; implies --enable-lora",
    )


def _add_lora_flags(p: argparse.ArgumentParser) -> None:
    """What the scheduler and its workers must agree on (`worker` has its own copy of these)."""
    p.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters: workers hold --max-loras adapter slots, requests name an adapter in adapter_id",
    )
    p.add_argument(
        "--max-lora-rank",
        type=int,
        default=64,
        help="largest LoRA rank accepted, and the size of each slot (default 64)",
    )


def _add_worker_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="auto = bfloat16 where fast, else float32")
    p.add_argument("--device", default="auto", help="auto (cuda:0 if present, else cpu), cpu, cuda:N")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="KV pool size in blocks (overrides profiling)")
    p.add_argument(
        "--kv-cache-gb",
        type=float,
        default=None,
        help="memory the KV pool may take (CPU default: 2, or 30%% of the available memory if less)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="on CUDA, the share of the device's memory weights, the heaviest step and the KV pool may take (default 0.9)",
    )
    p.add_argument(
        "--swap-space-gb",
        type=float,
        default=None,
        help="host memory (pinned on CUDA) that holds preempted sequences' KV blocks (default: 4 with CUDA, "
        "1 on CPU, or 10%% of the available memory if less; 0 = no swapping)",
    )
    p.add_argument(
        "--num-cpu-blocks", type=int, default=None, help="swap pool size in blocks (overrides --swap-space-gb)"
    )
    p.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="worker kernels: auto = triton on CUDA, cpu (our C++ kernels, built on first use) on CPU; torch = the reference",
    )
    p.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel group size: one rank process per device (default 1)"
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on CUDA, run every step eagerly (default: decode steps replay CUDA graphs captured at start)",
    )
    p.add_argument(
        "--profile-steps",
        action="store_true",
        help="time each step by part (linears, attention, sampling, ...) into the scheduler's "
        "llmserve:step_part_seconds metric; costs a little speed (on CUDA a device sync per part)",
    )
    p.add_argument(
        "--dist-timeout",
        type=float,
        default=60.0,
        help="seconds a collective may wait for the other ranks before the group gives up (default 60)",
    )
    p.add_argument(
        "--max-loras",
        type=_at_least(1, int),
        default=4,
        help="with --enable-lora: distinct adapters one step may use, i.e. device slots per worker (default 4)",
    )
    p.add_argument(
        "--max-cpu-loras",
        type=_at_least(1, int),
        default=None,
        help="with --enable-lora: adapters a worker keeps in host memory to refill slots from (default --max-loras)",
    )


def _add_http_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--http-port",
        type=int,
        default=DEFAULT_HTTP_PORT,
        help=f"port of the OpenAI HTTP API (/v1/completions, /v1/chat/completions, /v1/models; default {DEFAULT_HTTP_PORT})",
    )
    p.add_argument(
        "--http-metrics-port",
        type=int,
        default=DEFAULT_METRICS_PORT,
        help=f"Prometheus port of the HTTP gateway (smg_* metrics; default {DEFAULT_METRICS_PORT})",
    )


DESCRIPTION = """llmserve: an LLM inference engine, a scheduler and GPU/CPU workers over gRPC, with
an OpenAI HTTP API in front (the smg gateway).

    llmserve up              serve a model on this machine: scheduler, worker(s), HTTP (make run)
    llmserve scheduler       the scheduler service alone, driving workers at --worker
    llmserve worker          one worker service alone (--scheduler: register with one)
    llmserve gateway         the OpenAI HTTP API over one or more running schedulers
    llmserve generate        stream one generation from a running service to the terminal
    llmserve prepare-model   download and convert the default model into the cache

`llmserve COMMAND --help` lists a command's options.
"""


def _at_least(low: float, kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type: argparse then names the flag when a value is out of range."""

    def parse(text: str) -> Any:
        value = kind(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
        return value

    parse.__name__ = kind.__name__  # what argparse prints for a value that does not parse
    return parse


def _at_most_one(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must lie in [0, 1], got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(
        prog="llmserve", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    root.add_argument(
        "--log-level",
        default=os.environ.get("LLMSERVE_LOG_LEVEL", "info"),
        choices=["debug", "info", "warning", "error"],
        help="least severe log lines shown (default info, or LLMSERVE_LOG_LEVEL); JSON when stderr is not a "
        "terminal, or as LLMSERVE_LOG_JSON=1/0 says",
    )
    sub = root.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run the scheduler and its workers locally")
    up.add_argument(
        "--workers",
        type=int,
        default=1,
        help="worker groups (data parallel), each with its own KV cache; with CUDA, group i takes the next --tp GPUs",
    )
    _add_model_flags(up)
    _add_server_flags(up, 50051)
    _add_security_flags(up)
    _add_scheduler_flags(up)
    _add_worker_flags(up)
    up.add_argument(
        "--no-http",
        action="store_true",
        help="serve gRPC only: do not start the OpenAI HTTP gateway (smg) in front of the scheduler",
    )
    _add_http_flags(up)

    sched = sub.add_parser("scheduler", help="run the scheduler service alone")
    _add_model_flags(sched)
    _add_server_flags(sched, 50051)
    _add_security_flags(sched)
    _add_scheduler_flags(sched)
    sched.add_argument(
        "--worker",
        action="append",
        default=[],
        help="worker address, e.g. 127.0.0.1:50052 or unix:///path.sock; a tensor-parallel group: its ranks' "
        "addresses, comma-separated, in rank order. Repeat it for several groups (data parallel). Without it, "
        "workers register themselves (llmserve worker --scheduler HOST:PORT)",
    )
    sched.add_argument(
        "--block-size",
        type=int,
        default=0,
        help="tokens per KV block every worker must use; 0 = the first worker's (default), later ones must match",
    )
    _add_worker_tls_flags(sched)
    sched.add_argument(
        "--step-timeout", type=float, default=600.0, help="seconds a step may take before the worker counts as lost"
    )
    sched.add_argument(
        "--worker-health-interval",
        type=float,
        default=5.0,
        help="seconds between gRPC health checks of each connected worker; 3 failures in a row and it counts as lost "
        "(default 5; 0 = off)",
    )

    worker = sub.add_parser("worker", help="run one worker service alone")
    _add_model_flags(worker)
    worker.add_argument("--listen", default="127.0.0.1:50052", help="address to serve on (host:port or unix:///path)")
    worker.add_argument("--max-num-batched-tokens", type=int, default=2048, help="largest step to profile memory for")
    worker.add_argument(
        "--max-num-seqs",
        type=int,
        default=256,
        help="largest decode batch to capture a CUDA graph for (the scheduler's --max-num-seqs; default 256)",
    )
    _add_lora_flags(worker)
    worker.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    worker.add_argument("--metrics-port", type=int, default=0, help="Prometheus metrics port of this worker; 0 = off")
    worker.add_argument(
        "--scheduler",
        default="",
        help="register with the scheduler at HOST:PORT and serve it for as long as this worker runs",
    )
    worker.add_argument("--advertise", default="", help="address the scheduler dials (default: --listen)")
    worker.add_argument(
        "--scheduler-tls-ca",
        default=None,
        help="PEM CA bundle the scheduler's certificate must chain to; any --scheduler-tls-* flag registers over TLS",
    )
    worker.add_argument(
        "--scheduler-tls-cert", default=None, help="PEM client certificate for a scheduler that demands one"
    )
    worker.add_argument("--scheduler-tls-key", default=None, help="PEM private key of --scheduler-tls-cert")
    worker.add_argument(
        "--scheduler-tls-server-name",
        default=None,
        help="name the scheduler's certificate is checked against, when it differs from the --scheduler host",
    )
    worker.add_argument("--group", default="", help=argparse.SUPPRESS)
    # Set by `worker --tp N` on each rank process it starts.
    worker.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    worker.add_argument("--world-size", type=int, default=None, help=argparse.SUPPRESS)
    worker.add_argument("--dist-init", default="", help=argparse.SUPPRESS)
    _add_security_flags(worker)
    _add_worker_flags(worker)

    gen = sub.add_parser(
        "generate",
        help="stream one generation from a running service",
        description="Stream one generation from a running llmserve (llmserve.v1.Generation) to the terminal; "
        "the text goes to stdout, token counts and the finish reason to stderr.",
    )
    gen.add_argument("prompt", help="the prompt text; with --chat, the user's message")
    gen.add_argument(
        "--address", default="127.0.0.1:50051", help="the scheduler's gRPC address (default 127.0.0.1:50051)"
    )
    gen.add_argument(
        "--chat", action="store_true", help="send the prompt as a user message through the model's chat template"
    )
    gen.add_argument("--system", default=None, help="with --chat: a system message before the user's")
    gen.add_argument(
        "--max-tokens",
        type=_at_least(0, int),
        default=128,
        help="tokens to generate at most (default 128; 0 = up to the end of the context)",
    )
    gen.add_argument("--temperature", type=_at_least(0.0, float), default=0.0, help="0 (default) = greedy")
    gen.add_argument(
        "--top-p", type=_at_most_one, default=0.0, help="nucleus sampling mass in (0, 1]; 0 (default) = off"
    )
    gen.add_argument(
        "--top-k", type=_at_least(0, int), default=0, help="sample among the k likeliest tokens; 0 (default) = off"
    )
    gen.add_argument("--seed", type=_at_least(0, int), default=None, help="makes sampling repeatable")
    gen.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="stop at this text; repeat for several"
    )
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")

    gw = sub.add_parser("gateway", help="run the OpenAI HTTP API (smg) over one or more running schedulers")
    gw.add_argument(
        "--scheduler",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a scheduler's gRPC address to route requests to; repeat it for several",
    )
    gw.add_argument(
        "--host", default="127.0.0.1", help="address the HTTP API and its metrics listen on (default 127.0.0.1)"
    )
    _add_http_flags(gw)
    gw.add_argument(
        "--policy",
        choices=POLICIES,
        default="cache_aware",
        help="how a request picks its scheduler; cache_aware (default) = the one whose prefix cache holds the "
        "longest part of the prompt, unless it is much busier than the others",
    )
    gw.add_argument(
        "--model-path",
        default=None,
        metavar="DIR",
        help="model directory the gateway reads the tokenizer and chat template from (default: fetched from a scheduler)",
    )
    gw.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds in-flight HTTP requests get to finish (default 30)",
    )
    gw.add_argument(
        "--k8s-selector",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="instead of --scheduler: route to the Kubernetes pods that carry this label (repeat: all must match), "
        "found and followed with the Kubernetes API (needs list/watch on pods)",
    )
    gw.add_argument(
        "--k8s-port", type=int, default=50051, help="gRPC port of the discovered scheduler pods (default 50051)"
    )
    gw.add_argument(
        "--k8s-namespace",
        default=None,
        help="namespace to watch for scheduler pods (default: every namespace, which needs cluster-wide permissions)",
    )

    sub.add_parser("prepare-model", help="download and convert the default model (once)")
    return root


# ---- commands ----


def cache_root() -> Path:
    """Where prepared models live: $LLMSERVE_CACHE, else ~/.cache/llmserve."""
    return Path(os.environ.get("LLMSERVE_CACHE", Path.home() / ".cache" / "llmserve"))


def _model_dir(arg: str | None) -> str:
    if arg:
        return arg
    from llmserve.model_prep import prepare_default_model

    return str(prepare_default_model(cache_root()))


def _run_until_signal(body: Callable[[asyncio.Event], Coroutine[Any, Any, None]]) -> None:
    """Run `body(stop)` in an event loop; SIGINT and SIGTERM set `stop`."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await body(stop)

    asyncio.run(main())


def _run_beside(main: MainThreadExecutor, body: Callable[[asyncio.Event], Coroutine[Any, Any, None]]) -> None:
    """Run `body(stop)` in an event loop on a thread of its own while this thread serves
    `main`'s calls, until `body` returns (its exception is raised here). SIGINT and SIGTERM
    set `stop`; Python runs their handlers on the main thread, which `main.run()` wakes
    often enough to do."""
    signalled = threading.Event()
    shared: dict[str, Any] = {}

    def on_signal(*_: object) -> None:
        signalled.set()
        loop, stop = shared.get("loop"), shared.get("stop")
        if loop is not None and stop is not None:
            loop.call_soon_threadsafe(stop.set)

    async def serve() -> None:
        stop = asyncio.Event()
        shared["loop"], shared["stop"] = asyncio.get_running_loop(), stop
        if signalled.is_set():  # a signal that came before the loop did
            stop.set()
        await body(stop)

    def loop_thread() -> None:
        try:
            asyncio.run(serve())
        except BaseException as error:  # noqa: BLE001 (raised again on the main thread)
            shared["error"] = error
        finally:
            main.shutdown(wait=False, cancel_futures=True)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        thread = threading.Thread(target=loop_thread, name="event-loop")
        thread.start()
        main.run()
        thread.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if "error" in shared:
        raise shared["error"]


class _Service(Protocol):
    async def start(self) -> int: ...
    async def stop(self) -> None: ...


async def _serve(server: _Service, stop: asyncio.Event) -> None:
    await server.start()
    try:
        await stop.wait()
    finally:
        await server.stop()


def _tls_config(a: argparse.Namespace) -> TlsConfig | None:
    if a.tls_cert is None and a.tls_key is None:
        if a.tls_client_ca is not None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key: mutual TLS runs inside TLS")
        return None
    if a.tls_cert is None or a.tls_key is None:
        raise ValueError("--tls-cert and --tls-key go together: give both or neither")
    return TlsConfig(cert=a.tls_cert, key=a.tls_key, client_ca=a.tls_client_ca)


def _client_tls_config(a: argparse.Namespace, peer: str) -> TlsClientConfig | None:
    """TLS to the `peer` ("worker" or "scheduler") from its --PEER-tls-* flags; None = plaintext."""
    ca, cert, key, server_name = (getattr(a, f"{peer}_tls_{k}") for k in ("ca", "cert", "key", "server_name"))
    if all(p is None for p in (ca, cert, key, server_name)):
        return None
    if (cert is None) != (key is None):
        raise ValueError(f"--{peer}-tls-cert and --{peer}-tls-key go together: give both or neither")
    return TlsClientConfig(ca=ca, cert=cert, key=key, server_name=server_name)


def _server_config(a: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=a.host,
        port=a.port,
        metrics_port=a.metrics_port,
        tls=_tls_config(a),
        reflection=not a.no_reflection,
        drain_timeout=a.drain_timeout,
    )


def _scheduler_config(a: argparse.Namespace) -> SchedulerConfig:
    return SchedulerConfig(
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_queue_len=a.max_queue_len,
        enable_prefix_caching=not a.no_prefix_caching,
        preemption_mode=a.preemption_mode,
        swap_bandwidth_gbps=a.swap_bandwidth_gbps,
        recompute_tokens_per_s=a.recompute_tokens_per_s,
        max_prompt_tokens=a.max_prompt_tokens,
        max_stop_strings=a.max_stop_strings,
        max_logprobs=a.max_logprobs,
        max_n=a.max_n,
        plan_ahead=a.plan_ahead,
        json_max_whitespace=a.json_max_whitespace,
        # `up` gives its worker's block size; a lone scheduler has its own flag (0 = adopt).
        block_size=a.block_size,
        enable_lora=_lora_enabled(a),
        max_lora_rank=a.max_lora_rank,
        lora_modules=_lora_modules(a.lora_modules),
    )


def _lora_enabled(a: argparse.Namespace) -> bool:
    return bool(a.enable_lora or getattr(a, "lora_modules", None))


def _lora_modules(items: list[str]) -> tuple[tuple[str, str], ...]:
    pairs = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules: {item!r} is not NAME=DIR")
        pairs.append((name, path))
    return tuple(pairs)


def _worker_config(a: argparse.Namespace, model: str) -> WorkerConfig:
    return WorkerConfig(
        model=model,
        dtype=a.dtype,
        device=a.device,
        cache=CacheConfig(
            block_size=a.block_size,
            num_gpu_blocks=a.num_gpu_blocks,
            kv_cache_gb=a.kv_cache_gb,
            swap_space_gb=a.swap_space_gb,
            num_cpu_blocks=a.num_cpu_blocks,
            gpu_memory_utilization=a.gpu_memory_utilization,
        ),
        max_num_batched_tokens=a.max_num_batched_tokens,
        attention_backend=a.attention_backend,
        profile_steps=a.profile_steps,
        enforce_eager=a.enforce_eager,
        max_num_seqs=a.max_num_seqs,
        # Only a rank process started by `worker --tp N` has these.
        rank=getattr(a, "rank", None) or 0,
        world_size=getattr(a, "world_size", None) or 1,
        dist_init_method=getattr(a, "dist_init", ""),
        dist_timeout=a.dist_timeout,
        lora=LoraConfig(a.max_loras, a.max_lora_rank, a.max_cpu_loras) if _lora_enabled(a) else None,
    )


def cmd_scheduler(a: argparse.Namespace) -> None:
    from scheduler_svc.api.server import SchedulerServer

    server_config, worker_tls = _server_config(a), _client_tls_config(a, "worker")
    model = _model_dir(a.model)

    async def body(stop: asyncio.Event) -> None:
        # gRPC aio objects belong to the running loop: build the server inside it.
        server = SchedulerServer(
            model,
            a.worker,
            server_config,
            _scheduler_config(a),
            step_timeout=a.step_timeout,
            worker_tls=worker_tls,
            health_interval=a.worker_health_interval,
        )
        await _serve(server, stop)

    _run_until_signal(body)


def _worker_args(a: argparse.Namespace, model: str) -> list[str]:
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
        "--attention-backend",
        a.attention_backend,
        "--max-num-batched-tokens",
        str(a.max_num_batched_tokens),
        "--max-num-seqs",
        str(a.max_num_seqs),
        "--dist-timeout",
        str(a.dist_timeout),
        "--gpu-memory-utilization",
        str(a.gpu_memory_utilization),
    ]
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
    if a.profile_steps:
        cmd += ["--profile-steps"]
    if a.enforce_eager:
        cmd += ["--enforce-eager"]
    if _lora_enabled(a):
        cmd += ["--enable-lora", "--max-lora-rank", str(a.max_lora_rank), "--max-loras", str(a.max_loras)]
        if a.max_cpu_loras is not None:
            cmd += ["--max-cpu-loras", str(a.max_cpu_loras)]
    return cmd


def _check_tp(model: str, tp: int) -> None:
    """Refuse a group size the model cannot split before any rank starts (ValueError: exit 2)."""
    if tp == 1:
        return
    import json

    from worker_svc.device.parallel import check_splittable

    config = json.loads((Path(model) / "config.json").read_text())
    heads = int(config["num_attention_heads"])
    check_splittable(tp, heads, int(config.get("num_key_value_heads") or heads), int(config["intermediate_size"]))


def _run_rank_launcher(a: argparse.Namespace, model: str) -> None:
    """`worker --tp N`: start the N ranks, end them all when one ends (or on SIGTERM)."""
    from llmserve.rank_launcher import RankLauncher

    _check_tp(model, a.tp)
    cmd = _worker_args(a, model)
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
    group = RankLauncher(cmd, a.listen, a.tp, metrics_port=a.metrics_port, advertise=a.advertise)
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
    if a.tp > 1 and a.rank is None:
        _run_rank_launcher(a, _model_dir(a.model))
        return
    from worker_svc.service.main_thread import MainThreadExecutor

    tls = _tls_config(a)
    model = _model_dir(a.model)
    # The model loads on this thread and every step runs on it (worker_svc/service/main_thread.py).
    steps = MainThreadExecutor()
    server = WorkerServer(
        _worker_config(a, model),
        a.listen,
        tls=tls,
        reflection=not a.no_reflection,
        metrics_port=a.metrics_port,
        registrar=_registrar(a, model),
        executor=steps,
    )
    _run_beside(steps, lambda stop: _serve(server, stop))
    sys.exit(server.exit_code)


def _registrar(a: argparse.Namespace, model: str) -> Any:
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
        tls=_client_tls_config(a, "scheduler"),
    )


def _log_json() -> bool:
    """JSON logs unless stderr is a terminal; LLMSERVE_LOG_JSON=1|0 forces one."""
    forced = os.environ.get("LLMSERVE_LOG_JSON")
    return forced == "1" if forced in ("0", "1") else not sys.stderr.isatty()


def _check_gateway_ports(config: GatewayConfig) -> None:
    """Both of the gateway's ports free, before anything starts (PortUnavailable: exit 2)."""
    check_free(f"{config.host}:{config.port}", "--http-port")
    check_free(f"{config.host}:{config.metrics_port}", "--http-metrics-port")


def _up_gateway_config(a: argparse.Namespace) -> GatewayConfig | None:
    """The gateway `up` runs in front of its scheduler, validated; None with --no-http. Its
    scheduler address is filled in once the port is bound (--port 0 picks one)."""
    if a.no_http:
        return None
    if a.tls_cert is not None:
        raise ValueError(
            "--tls-cert: the HTTP gateway dials the scheduler in plaintext and cannot reach a TLS port; add --no-http"
        )
    taken = {a.port: "--port", **({a.metrics_port: "--metrics-port"} if a.metrics_port else {})}
    for flag, port in (("--http-port", a.http_port), ("--http-metrics-port", a.http_metrics_port)):
        if port in taken:
            raise ValueError(f"{flag} {port} is also {taken[port]}: give each its own port")
    return GatewayConfig(
        schedulers=(dial_address(a.host, a.port or 1),),
        host=a.host,
        port=a.http_port,
        metrics_port=a.http_metrics_port,
        shutdown_grace=a.drain_timeout,
        log_level=a.log_level,
        log_json=_log_json(),
    )


def _gateway_config(a: argparse.Namespace) -> GatewayConfig:
    """`llmserve gateway`: its schedulers, listed or discovered."""
    discovery = None
    if a.k8s_selector:
        if a.scheduler:
            raise ValueError("--scheduler and --k8s-selector exclude each other: list the schedulers or discover them")
        discovery = KubernetesDiscovery(tuple(a.k8s_selector), a.k8s_port, a.k8s_namespace)
    elif not a.scheduler:
        raise ValueError(
            "llmserve gateway needs --scheduler HOST:PORT (repeat it for several) or --k8s-selector KEY=VALUE"
        )
    return GatewayConfig(
        schedulers=tuple(a.scheduler),
        discovery=discovery,
        host=a.host,
        port=a.http_port,
        metrics_port=a.http_metrics_port,
        policy=a.policy,
        model_path=a.model_path,
        shutdown_grace=a.drain_timeout,
        log_level=a.log_level,
        log_json=_log_json(),
    )


def cmd_gateway(a: argparse.Namespace) -> None:
    config = _gateway_config(a)
    executable = smg_executable()
    _check_gateway_ports(config)

    async def body(stop: asyncio.Event) -> None:
        gateway = Gateway(config, executable)
        gateway.start()
        try:
            while not stop.is_set():
                gateway.restart_if_dead()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)
        finally:
            await asyncio.to_thread(gateway.stop)

    _run_until_signal(body)


def cmd_up(a: argparse.Namespace) -> None:
    from scheduler_svc.api.server import SchedulerServer

    server_config = _server_config(a)
    model = _model_dir(a.model)
    _worker_config(a, model)  # validate worker flags before starting anything
    _check_tp(model, a.tp)
    if a.workers < 1:
        raise ValueError(f"--workers must be at least 1, got {a.workers}")
    gateway_config = _up_gateway_config(a)
    smg = None
    if gateway_config is not None:
        smg = smg_executable()
        _check_gateway_ports(gateway_config)
    # The scheduler's ports too, before a worker starts loading (PortUnavailable: exit 2).
    check_free(f"{a.host}:{a.port}", "--port")
    if a.metrics_port:
        check_free(f"{a.host}:{a.metrics_port}", "--metrics-port")
    sockdir = tempfile.mkdtemp(prefix="llmserve-")
    commands, addresses = [], []
    for i in range(a.workers):
        address = f"unix://{sockdir}/worker-{i}.sock"
        commands.append(
            [*_worker_args(a, model), "--listen", address, "--parent-pid", str(os.getpid()), "--tp", str(a.tp)]
        )
        if a.tp > 1:
            from llmserve.rank_launcher import rank_addresses

            address = ",".join(rank_addresses(address, a.tp))
        addresses.append(address)
    # The TLS flags secure the public scheduler port only. The worker's socket lies in a
    # mkdtemp directory (mode 0700) that only this user's processes can enter, and nothing
    # but our own scheduler dials it, so TLS there would cost handshakes and guard nothing.

    async def body(stop: asyncio.Event) -> None:
        # Workers in sessions of their own: Ctrl-C in a terminal signals the whole foreground
        # process group, and a worker that stopped on it would be lost under a running step;
        # only `up` gets it, and drains like on SIGTERM.
        workers = [
            Supervised(cmd, env=_gpu_share(i, a.tp, a.workers), own_session=True) for i, cmd in enumerate(commands)
        ]
        server: SchedulerServer | None = None
        gateway: Gateway | None = None
        try:
            for worker in workers:
                worker.start()
            starting = SchedulerServer(model, addresses, server_config, _scheduler_config(a))
            port = await starting.start()
            server = starting
            while not stop.is_set():
                for worker in workers:
                    worker.restart_if_dead()
                if gateway is not None:
                    gateway.restart_if_dead()
                    if not gateway.announced:
                        # The scheduler's `ready` line comes before smg answers on the HTTP
                        # port; `http_ready` marks that moment. In a thread: the probe may wait.
                        await asyncio.to_thread(gateway.announce_when_ready)
                elif gateway_config is not None and server.engine.ready:
                    # Once requests can be answered. Started earlier, smg would report itself
                    # ready at once (it counts a registered scheduler as healthy until health
                    # checks fail) and answer requests with the scheduler's UNAVAILABLE.
                    gateway = Gateway(replace(gateway_config, schedulers=(dial_address(a.host, port),)), smg)
                    gateway.start()
                waiting_for_ready = gateway_config is not None and (gateway is None or not gateway.announced)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.2 if waiting_for_ready else 1.0)
        finally:
            log.info("shutting_down")
            if gateway is not None:
                # First, and in a thread: smg drains its HTTP requests through the scheduler,
                # which this event loop keeps serving meanwhile.
                await asyncio.to_thread(gateway.stop)
            if server is not None:
                await server.stop()
            for worker in workers:
                worker.stop()
            shutil.rmtree(sockdir, ignore_errors=True)

    _run_until_signal(body)


def _gpu_share(index: int, tp: int, groups: int) -> dict[str, str] | None:
    """The environment of worker group `index`: its own `tp` of the visible GPUs.

    Worked out from CUDA_VISIBLE_DEVICES rather than by asking torch, which the scheduler's
    process never imports; with one group, or on a machine without GPUs, nothing changes.
    """
    if groups == 1:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(d) for d in range(groups * tp)]
    share = devices[index * tp : (index + 1) * tp]
    if len(share) < tp:
        raise ValueError(
            f"--workers {groups} x --tp {tp} needs {groups * tp} GPUs, CUDA_VISIBLE_DEVICES lists {len(devices)}"
        )
    return {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(share)}


def cmd_generate(a: argparse.Namespace) -> None:
    import grpc

    from common.pb.llmserve.v1 import generation_pb2 as pb
    from common.pb.llmserve.v1 import generation_pb2_grpc

    if a.system is not None and not a.chat:
        raise ValueError("--system needs --chat")
    sampling = pb.SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k)
    if a.seed is not None:
        sampling.seed = a.seed
    request = pb.GenerateRequest(
        sampling=sampling,
        stopping=pb.StoppingCriteria(max_tokens=a.max_tokens, stop=a.stop, ignore_eos=a.ignore_eos),
    )
    if a.chat:
        if a.system is not None:
            request.messages.add(role="system", content=a.system)
        request.messages.add(role="user", content=a.prompt)
    else:
        request.prompt = a.prompt
    with grpc.insecure_channel(a.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        last = None
        try:
            for last in stub.Generate(request):
                sys.stdout.write(last.text)
                sys.stdout.flush()
        except grpc.RpcError as error:
            sys.stdout.write("\n")
            sys.exit(f"error: {error.code().name}: {_flag_names(error.details() or '')}")
    sys.stdout.write("\n")
    if last is not None:
        reason = pb.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
        print(
            f"[{last.prompt_tokens} prompt tokens, {last.completion_tokens} generated, finish: {reason}]",
            file=sys.stderr,
        )


# The request fields `generate` sets, by the flag that sets them: the server's errors name fields.
_GENERATE_FLAGS = {
    "sampling.temperature": "--temperature",
    "sampling.top_p": "--top-p",
    "sampling.top_k": "--top-k",
    "sampling.seed": "--seed",
    "stopping.max_tokens": "--max-tokens",
    "stopping.stop": "--stop",
    "messages": "--chat",
    "prompt": "prompt",
}


def _flag_names(details: str) -> str:
    """The server's message, with the flag beside each request field it names."""
    for field, flag in _GENERATE_FLAGS.items():
        if details.startswith(f"{field}:") or details.startswith(f"{field}["):
            return f"{flag} ({details})"
    return details


def cmd_prepare_model(a: argparse.Namespace) -> None:
    from llmserve.model_prep import prepare_default_model

    print(prepare_default_model(cache_root()))


COMMANDS: dict[str, Callable[[argparse.Namespace], None]] = {
    "up": cmd_up,
    "scheduler": cmd_scheduler,
    "worker": cmd_worker,
    "generate": cmd_generate,
    "gateway": cmd_gateway,
    "prepare-model": cmd_prepare_model,
}


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    logsetup.configure(args.log_level, json=_log_json())
    # A crash in native code (a kernel, gRPC, torch) then leaves the Python stack of every
    # thread on stderr instead of a bare exit status.
    faulthandler.enable()
    try:
        COMMANDS[args.command](args)
    except ValueError as error:
        # Configuration mistakes (bad flags, bad model directory) are the user's to fix.
        log.error("invalid_configuration", reason=str(error))
        sys.exit(2)


if __name__ == "__main__":
    main()
