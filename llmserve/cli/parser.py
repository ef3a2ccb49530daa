"""The `llmserve` command line: its subcommands and the flags only one of them takes.

The groups several commands share are in flags.py; this module puts them together per
command. `main` parses with it, and the offline `LLM` parses its keyword arguments as an
`up` command line with it (llmserve/engine_args.py).
"""

from __future__ import annotations

import argparse
import os

from llmserve.cli.flags import (
    add_client_auth_flags,
    add_gateway_port_flags,
    add_http_flags,
    add_lora_flags,
    add_model_flags,
    add_registry_flags,
    add_scheduler_flags,
    add_security_flags,
    add_served_name_flag,
    add_server_flags,
    add_worker_flags,
    add_worker_tls_flags,
    add_worker_token_flags,
    at_least,
    at_most_one,
)
from llmserve.gateway import POLICIES

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


def build_parser() -> argparse.ArgumentParser:
    """The whole `llmserve` command line: the global flags and every subcommand with its own."""
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
    add_model_flags(up)
    add_served_name_flag(up, several=True)
    add_server_flags(up, 50051)
    add_security_flags(up)
    add_client_auth_flags(up)
    add_scheduler_flags(up)
    add_worker_flags(up)
    up.add_argument(
        "--no-http",
        action="store_true",
        help="serve gRPC only: do not start the OpenAI HTTP gateway (smg) in front of the scheduler",
    )
    add_http_flags(up)

    sched = sub.add_parser("scheduler", help="run the scheduler service alone")
    add_model_flags(sched)
    add_served_name_flag(sched, several=False)
    add_server_flags(sched, 50051)
    add_security_flags(sched)
    add_client_auth_flags(sched)
    add_worker_token_flags(sched)
    add_registry_flags(sched)
    add_gateway_port_flags(sched)
    add_scheduler_flags(sched)
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
    add_worker_tls_flags(sched)
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
    add_model_flags(worker)
    worker.add_argument("--listen", default="127.0.0.1:50052", help="address to serve on (host:port or unix:///path)")
    worker.add_argument("--max-num-batched-tokens", type=int, default=2048, help="largest step to profile memory for")
    worker.add_argument(
        "--max-num-seqs",
        type=int,
        default=256,
        help="largest decode batch to capture a CUDA graph for (the scheduler's --max-num-seqs; default 256)",
    )
    add_lora_flags(worker)
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
    add_security_flags(worker)
    add_worker_token_flags(worker)
    add_worker_flags(worker)

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
        type=at_least(0, int),
        default=128,
        help="tokens to generate at most (default 128; 0 = up to the end of the context)",
    )
    gen.add_argument("--temperature", type=at_least(0.0, float), default=0.0, help="0 (default) = greedy")
    gen.add_argument(
        "--top-p", type=at_most_one, default=0.0, help="nucleus sampling mass in (0, 1]; 0 (default) = off"
    )
    gen.add_argument(
        "--top-k", type=at_least(0, int), default=0, help="sample among the k likeliest tokens; 0 (default) = off"
    )
    gen.add_argument("--seed", type=at_least(0, int), default=None, help="makes sampling repeatable")
    gen.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="stop at this text; repeat for several"
    )
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    gen.add_argument(
        "--api-key",
        default=os.environ.get("LLMSERVE_API_KEY", "").split(",")[0].strip() or None,
        help="key of a server started with --api-key (default: the first of LLMSERVE_API_KEY)",
    )

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
    add_http_flags(gw)
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
        "--model-alias",
        action="append",
        default=[],
        metavar="ALIAS=NAME",
        help="accept ALIAS in requests for the model the schedulers serve as NAME; repeat it for several",
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
    # The schedulers' keys: HTTP requests must carry one (else 401). smg shows no key to the
    # schedulers, so behind keys --scheduler (and --k8s-port) name their --gateway-port.
    add_client_auth_flags(gw)

    sub.add_parser("prepare-model", help="download and convert the default model (once)")
    return root
